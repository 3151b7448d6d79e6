"""Attention within packed rows (per sample, a shared prompt's branches apart) and float32 matmul attention."""

import inspect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def sequence_bounds(position_ids, rows: int, length: int) -> dict:
    """Where the samples of each packed row start, from the restarts of position_ids (B or 1, L): per-row
    start lists, the samples' int32 offsets in the flattened (B * L) batch and the longest sample. A restart
    at a position other than 0 is a branch of the sample (a shared prompt's rollout, lib/trainer/packing.py
    shared_prompts): per-row lists of (sample start, its branch starts). Finding them costs a host sync: a
    forward computes them once and passes them to every layer (packed_attention's `sequence_bounds`)."""
    import torch

    positions = position_ids.expand(rows, -1)  # (B, L)
    restarts = torch.diff(positions, dim=-1) != 1  # (B, L-1)
    kinds = restarts.long() * torch.where(positions[:, 1:] == 0, 1, 2)  # (B, L-1): 1 sample, 2 branch
    found = kinds.nonzero()  # (N, 2)
    rows_at, at = found.unbind(1)
    read = torch.stack([kinds[rows_at, at], positions[rows_at, at + 1]], 1)  # (N, 2): kind, position
    starts, branches = [[0] for _ in range(rows)], [[] for _ in range(rows)]
    for (row, t), (kind, position) in zip(found.tolist(), read.tolist()):
        if kind == 1:
            starts[row].append(t + 1)
        elif branches[row] and branches[row][-1][0] == starts[row][-1]:
            branches[row][-1][1].append(t + 1)
        else:  # the first branch follows the prompt unbroken: it starts where this one's position says
            branches[row].append((starts[row][-1], [starts[row][-1] + position, t + 1]))
    flat = [row * length + s for row, row_starts in enumerate(starts) for s in row_starts] + [rows * length]
    bounds = {
        "starts": starts,
        "branches": branches,
        "cu_seqlens": torch.tensor(flat, dtype=torch.int32, device=position_ids.device),  # (samples + 1,)
        "max_seqlen": max(e - s for s, e in zip(flat, flat[1:])),
    }
    return bounds


def previous_tokens(bounds: dict, rows: int, length: int, device) -> "torch.Tensor":
    """(B * L,) flat index of the position whose hidden state predicts each token of the rows: the one before
    it, but for a branch's first token the last token of its sample's prompt (sequence_bounds)."""
    import torch

    previous = torch.arange(-1, rows * length - 1, device=device)  # (B * L,)
    fixed = [
        (row * length + branch, row * length + forks[0] - 1)
        for row, row_branches in enumerate(bounds["branches"])
        for _, forks in row_branches
        for branch in forks[1:]
    ]
    if fixed:
        at, source = torch.tensor(fixed, device=device).unbind(1)
        previous[at] = source
    return previous


# A bf16 sample up to this long attends through float32 matmuls on a CPU, where SDPA's causal kernel took ~1.5x
# longer over a forward and backward of 100-token samples (float32_attention).
SHORT_SAMPLE = 128
VARLEN_DEVICES = ("cuda",)  # devices with a variable-length attention kernel (torch's has no CPU backend)


def varlen_kernel():
    """(name, function) of flash-attn's variable-length kernel when installed, else torch's."""
    import importlib.util

    if importlib.util.find_spec("flash_attn"):
        from flash_attn import flash_attn_varlen_func

        return "flash_attn", flash_attn_varlen_func
    from torch.nn.attention import varlen  # torch >= 2.10 (the lock pins 2.13)

    return "torch", varlen.varlen_attn


def packed_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    position_ids=None,
    packed_bounds=None,
    **kwargs,
):
    """Causal attention inside each sample of a packed row, as a transformers attention function.

    SDPA with transformers' block-diagonal mask computes every row_length^2 score and masks most of
    them. On CUDA a variable-length kernel (flash-attn's, or torch's) attends within each sample of the
    flattened batch in one call; elsewhere one causal SDPA call per sample costs the sum of the
    samples' length^2. Samples start where position ids restart (the convention of build_rows);
    `packed_bounds`, a keyword of the model's forward that reaches every layer, saves finding them again.
    """
    import torch

    assert attention_mask is None and dropout == 0.0, "packed attention takes neither a mask nor dropout"
    rows, heads, length, dim = query.shape  # query (B, H, L, D); key, value (B, KV heads, L, D)
    if position_ids is None:
        position_ids = torch.arange(length, device=query.device)[None]  # (1, L): one sample per row
    # The forward's caller passes the boundaries once for every layer (lib/trainer/head.py); else each layer finds them.
    bounds = packed_bounds or sequence_bounds(position_ids, rows, length)
    device = query.device.type
    if torch.is_autocast_enabled(device):
        # Autocast casts matmul inputs, not attention's: Qwen3's q/k norms and RoPE leave q and k in float32
        # (the master weights' dtype) while v comes out of a projection in bf16.
        dtype = torch.get_autocast_dtype(device)
        query, key, value = (x.to(dtype) for x in (query, key, value))
    # The flash kernels take half precision only (bf16 under autocast); fp32 on CUDA takes the SDPA loop.
    half = query.dtype in (torch.float16, torch.bfloat16)
    # A shared prompt's branches need a mask the variable-length kernels do not take: the loop takes them.
    forked = any(bounds["branches"])
    kernel = varlen_kernel() if device in VARLEN_DEVICES and half and not forked else None
    if kernel is not None:
        # Flattened (B * L, heads, D): a sample never spans two rows, so the row ends are sample ends too.
        q, k, v = (x.transpose(1, 2).reshape(rows * length, x.shape[1], dim) for x in (query, key, value))
        cu, longest = bounds["cu_seqlens"], bounds["max_seqlen"]
        name, attend = kernel
        if name == "flash_attn":
            out = attend(q, k, v, cu, cu, longest, longest, softmax_scale=scaling, causal=True)
        else:  # window (-1, 0): causal
            gqa = {"enable_gqa": True}
            if "enable_gqa" not in inspect.signature(attend).parameters:
                # torch < 2.13 (2.11 on some GPU machines) has no GQA here: repeat the key/value heads.
                k, v = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (k, v))
                gqa = {}
            out = attend(q, k, v, cu, cu, longest, longest, scale=scaling, window_size=(-1, 0), **gqa)
        return out.reshape(rows, length, heads, dim), None  # (B, L, H, D)
    out = []
    for row, row_starts in enumerate(bounds["starts"]):
        edges = [*row_starts, length]
        forks = dict(bounds["branches"][row])  # sample start -> its branch starts
        pieces = [
            sample_attention(
                query[row : row + 1, :, s:e],
                key[row : row + 1, :, s:e],
                value[row : row + 1, :, s:e],
                scaling,
                [b - s for b in forks.get(s, ())],
            )
            for s, e in zip(edges, edges[1:])
        ]
        out.append(torch.cat(pieces, dim=2))  # (1, H, L, D)
    return torch.cat(out).transpose(1, 2).contiguous(), None  # (B, L, H, D)


def use_packed_attention(model) -> None:
    """Switches a transformers model from sdpa to packed_attention (the saved config is unaffected)."""
    from transformers import AttentionInterface

    AttentionInterface.register("plainrl_packed", packed_attention)
    model.set_attn_implementation("plainrl_packed")


def sample_attention(query, key, value, scaling, branches=()):
    """Causal attention within one sample: (1, heads, L, D) and (1, kv heads, L, D) -> (1, heads, L, D). With
    `branches` (offsets where its branches start), a token of a branch sees the tokens before the first branch
    (the shared prompt) and those of its own branch before it."""
    import torch
    import torch.nn.functional as F

    length = query.shape[2]
    short = query.device.type == "cpu" and query.dtype == torch.bfloat16 and length <= SHORT_SAMPLE
    if not (short or branches):
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=True
        )
    visible = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()  # (L, L)
    if branches:
        starts = torch.tensor(branches, device=query.device)
        # (L,) each token's branch, 0 for the prompt
        branch = torch.bucketize(torch.arange(length, device=query.device), starts, right=True)
        visible &= (branch[None, :] == 0) | (branch[None, :] == branch[:, None])
    if short:
        return float32_attention(query, key, value, visible[None, None], scaling)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=visible, scale=scaling, enable_gqa=True
    )


def float32_attention(query, key, value, mask=None, scaling=None):
    """Attention as two matmuls in float32, each key/value head's query heads taken together (no copies of
    the grouped heads): query (B, heads, Q, D), key and value (B, kv heads, T, D), mask None or (B or 1, 1, Q,
    T), bool (True attends) or additive -> (B, heads, Q, D) in query's dtype. On a CPU, SDPA's kernel took
    4-5x longer for a decode step (64 rows of SmolLM2, bf16) and ~1.5x for a short sample's causal forward and
    backward; float32 scores keep it as close to a float64 reference as SDPA (tests/test_engine.py)."""
    import torch

    batch, heads, length, dim = query.shape
    groups, keys = key.shape[1], key.shape[2]
    with torch.autocast(query.device.type, enabled=False):  # float32 even inside a bf16 autocast region
        grouped = query.float().reshape(batch, groups, heads // groups * length, dim)  # rows: (head, query)
        scores = grouped @ key.float().transpose(-1, -2)  # (B, kv, heads per kv x Q, T)
        weights = attention_weights(scores, query.shape, mask, keys, scaling)
        out = weights @ value.float()  # (B, kv, heads per kv x Q, D)
    return out.view(batch, heads, length, dim).to(query.dtype)


def block_attention(query, key, value, mask=None, scaling=None):
    """float32_attention over a decode step's cache in blocks (lib/inference/server/kv.py BlockLayer): key and value
    are Blocks of (blocks, B, kv heads, BLOCK, D) float32 holding `length` tokens, zeros after them. Each
    matmul runs over the blocks, every one a contiguous run of memory; the scores are then laid end to end,
    so the softmax and the mask are float32_attention's."""
    import torch

    batch, heads, length, dim = query.shape
    blocks, _, groups, block, _ = key.data.shape
    with torch.autocast(query.device.type, enabled=False):
        grouped = query.float().reshape(batch, groups, heads // groups * length, dim)
        scores = grouped @ key.data.transpose(-1, -2)  # (blocks, B, kv, heads per kv x Q, BLOCK)
        scores = scores.permute(1, 2, 3, 0, 4).flatten(3)  # (B, kv, heads per kv x Q, blocks x BLOCK)
        if mask is None:
            mask = torch.arange(blocks * block, device=query.device) < key.length  # the tokens held
        else:  # (B or 1, 1, Q, length) -> (..., blocks x BLOCK), the zeros past `length` hidden
            fill = False if mask.dtype == torch.bool else float("-inf")
            mask = torch.nn.functional.pad(
                mask[..., : key.length], (0, blocks * block - key.length), value=fill
            )
        weights = attention_weights(scores, query.shape, mask, blocks * block, scaling)
        weights = weights.unflatten(-1, (blocks, block)).permute(
            3, 0, 1, 2, 4
        )  # (blocks, B, kv, rows, BLOCK)
        out = (weights @ value.data).sum(0)  # (B, kv, heads per kv x Q, D)
    return out.view(batch, heads, length, dim).to(query.dtype)


def attention_weights(scores, shape, mask, keys: int, scaling):
    """Softmax weights from float32 scores (B, kv, heads per kv x Q, T) of a query of `shape` (B, heads, Q,
    D), scaled, with mask None or (B or 1, 1, Q, >= T) (or (T,)), bool (True attends) or additive."""
    import torch

    batch, heads, length, dim = shape
    groups = scores.shape[1]
    scale = dim**-0.5 if scaling is None else scaling
    scores = (scores * scale).view(batch, groups, heads // groups, length, keys)
    if mask is not None:
        mask = mask[..., :keys].unsqueeze(1) if mask.dim() == 4 else mask  # (B or 1, 1, 1, Q, T)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return scores.softmax(dim=-1).view(batch, groups, heads // groups * length, keys)
