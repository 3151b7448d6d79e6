"""Packing: sequences into rows of seq_len (SFT rows and RL micro-batches alike), and attention within each sequence."""

import dataclasses
import inspect
from typing import TYPE_CHECKING

from lib.config import UserError

if TYPE_CHECKING:
    import torch

    from lib.rollouts import Rollout


# ---------------------------------------------------------------- rows


def first_fit(lengths: list[int], seq_len: int) -> list[list[int]]:
    """First-fit decreasing: sequence indices grouped into rows of at most seq_len tokens."""
    rows, free = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > seq_len:
            raise UserError(
                f"a sequence of {lengths[i]} tokens does not fit in seq_len {seq_len}; raise seq_len."
            )
        for r, space in enumerate(free):
            if lengths[i] <= space:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(seq_len - lengths[i])
    return rows


def row_layout(lengths: list[int], seq_len: int, packing: bool) -> list[list[int]]:
    """Which sequences share each row: first-fit packed, or one per row, longest first (rows taken in
    order then pad little)."""
    if packing:
        return first_fit(lengths, seq_len)
    return [[i] for i in sorted(range(len(lengths)), key=lambda i: -lengths[i])]


def build_rows(layout: list[list[int]], columns: dict[str, tuple[list[list], object, "torch.dtype"]]) -> dict:
    """(R, T) tensors, one per column plus position_ids: row r holds the sequences layout[r] back to back,
    padded on the right to the longest row. A column is (values per sequence, padding value, dtype).

    Positions restart at 0 for each sequence, which is how transformers and packed_attention tell
    packed sequences apart (no attention_mask is passed). Padding continues the last position, so it
    reads as part of the row's last sequence: causal attention keeps real tokens from seeing it, and a
    row of one sequence stays plain causal (no mask is built).
    """
    import torch

    lengths = {i: len(next(iter(columns.values()))[0][i]) for row in layout for i in row}
    width = max(sum(lengths[i] for i in row) for row in layout)
    tensors = {}
    for name, (per_sequence, padding, dtype) in columns.items():
        assert all(len(per_sequence[i]) == n for i, n in lengths.items()), f"column {name} differs in length"
        tensor = torch.full((len(layout), width), padding, dtype=dtype)  # (R, T)
        for r, row in enumerate(layout):
            values = [value for i in row for value in per_sequence[i]]
            tensor[r, : len(values)] = torch.tensor(values, dtype=dtype)
        tensors[name] = tensor
    position_ids = torch.arange(width).repeat(len(layout), 1)  # (R, T)
    for r, row in enumerate(layout):
        positions = [t for i in row for t in range(lengths[i])]
        position_ids[r, : len(positions)] = torch.tensor(positions)
        position_ids[r, len(positions) :] += positions[-1] + 1 - len(positions)
    tensors["position_ids"] = position_ids
    return tensors


def sft_rows(samples: list[tuple[list[int], list[int]]], seq_len: int, packing: bool, pad_id: int):
    """SFT rows of (token ids, 0/1 loss mask) samples: input ids, position ids and the loss mask, each
    (rows, length), aligned as RL's are: mask[t] marks a token t the model is trained to predict from the
    tokens before it (lib/head.py next_token_scores). A sample's first token is never trained on: it would
    be predicted from the previous sample of the row."""
    import torch

    masks = [[False] + [bool(m) for m in mask[1:]] for _, mask in samples]
    layout = row_layout([len(ids) for ids, _ in samples], seq_len, packing)
    rows = build_rows(
        layout,
        {
            "input_ids": ([ids for ids, _ in samples], pad_id, torch.long),
            "loss_mask": (masks, False, torch.bool),
        },
    )
    return rows["input_ids"], rows["position_ids"], rows["loss_mask"]


@dataclasses.dataclass
class MicroBatch:
    """One RL forward/backward's worth of rows (see build_rows); every tensor is (R, T).

    Call the model with position_ids, no attention_mask and use_cache=False (with a KV cache
    transformers skips the check and lets packed rollouts attend to each other).
    """

    input_ids: "torch.Tensor"
    """Token ids (long); padding after the last rollout of a row."""
    position_ids: "torch.Tensor"
    """Position of each token within its own rollout (long); padding continues the last rollout's."""
    loss_mask: "torch.Tensor"
    """True on sampled tokens (bool); False on prompts, env turns and padding."""
    inference_logp: "torch.Tensor"
    """Server logprob of each token (float32); 0 off the loss mask."""
    advantages: "torch.Tensor"
    """The rollout's advantage on each of its tokens (float32); 0 on padding."""
    rollout_index: "torch.Tensor"
    """Which rollout of the step's list each token belongs to (long); -1 on padding. A rollout lies whole in one
    row of one micro-batch, so sequence-level quantities (lib/loss.py) are complete in the micro-batch."""
    kept_counts: "torch.Tensor | None" = None
    """Served kept sets: how many kept ids each token has (int32), > 0 on the loss mask; None when the rollouts
    carry none (lib/head.py KeptSets)."""
    kept_ids: "torch.Tensor | None" = None
    """Served kept sets: every token's kept ids (int32, (K,)), one token after the other, rows in order."""

    def to(self, device) -> "MicroBatch":
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return MicroBatch(
            **{name: None if value is None else value.to(device) for name, value in fields.items()}
        )

    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def rl_micro_batches(
    rollouts: list["Rollout"],
    seq_len: int,
    rows_per_micro_batch: int = 1,
    pad_token_id: int = 0,
    num_micro_batches_multiple: int = 1,
    packing: bool = True,
) -> list[MicroBatch]:
    """Rollouts in rows of at most seq_len tokens (one per row with packing off, then the model needs no
    packed attention), rows_per_micro_batch rows to a micro-batch, each padded to its longest row.

    Empty micro-batches (one padding token, no loss) are appended until their number is a multiple of
    num_micro_batches_multiple, so every rank runs the same number of forward/backward passes in lockstep.
    """
    import torch

    for r in rollouts:
        assert len(r.token_ids) == len(r.loss_mask) == len(r.inference_logp), (
            "rollout fields differ in length"
        )
        # token_logp gives the first token of a packed rollout a value predicted from the previous one.
        assert not r.loss_mask[0], "a rollout cannot start with a sampled token (it has no context)"
    layout = row_layout([len(r.token_ids) for r in rollouts], seq_len, packing)
    columns = {
        "input_ids": ([r.token_ids for r in rollouts], pad_token_id, torch.long),
        "loss_mask": ([r.loss_mask for r in rollouts], False, torch.bool),
        "inference_logp": (
            [[lp if m else 0.0 for lp, m in zip(r.inference_logp, r.loss_mask)] for r in rollouts],
            0.0,
            torch.float32,
        ),
        "advantages": ([[r.advantage] * len(r.token_ids) for r in rollouts], 0.0, torch.float32),
        "rollout_index": ([[i] * len(r.token_ids) for i, r in enumerate(rollouts)], -1, torch.long),
    }
    served = [r.kept_counts is not None for r in rollouts]
    assert all(served) or not any(served), "some rollouts carry served kept sets and others none"
    if rollouts and all(served):
        columns["kept_counts"] = ([r.kept_counts.tolist() for r in rollouts], 0, torch.int32)
    micro_batches = []
    for first in range(0, len(layout), rows_per_micro_batch):
        rows = layout[first : first + rows_per_micro_batch]
        micro_batch = MicroBatch(**build_rows(rows, columns))
        if "kept_counts" in columns:  # the ids in the order of the tokens they belong to
            ids = [torch.from_numpy(rollouts[i].kept_ids) for row in rows for i in row]
            micro_batch.kept_ids = torch.cat(ids)
        micro_batches.append(micro_batch)
    while len(micro_batches) % num_micro_batches_multiple:
        empty = torch.zeros((1, 1), dtype=torch.long)  # (1, 1)
        micro_batches.append(
            MicroBatch(
                torch.full_like(empty, pad_token_id),
                empty.clone(),
                empty.bool(),
                empty.float(),
                empty.float(),
                torch.full_like(empty, -1),
            )
        )
    return micro_batches


# ---------------------------------------------------------------- attention over packed rows


def sequence_bounds(position_ids, rows: int, length: int) -> dict:
    """Where the samples of each packed row start, from the restarts of position_ids (B or 1, L): per-row
    start lists, the samples' int32 offsets in the flattened (B * L) batch and the longest sample. Finding
    them costs a host sync: a forward computes them once and passes them to every layer (packed_attention's
    `sequence_bounds`)."""
    import torch

    restarts = torch.diff(position_ids.expand(rows, -1), dim=-1) != 1  # (B, L-1)
    starts = [[0] for _ in range(rows)]
    for row, t in restarts.nonzero().tolist():
        starts[row].append(t + 1)
    flat = [row * length + s for row, row_starts in enumerate(starts) for s in row_starts] + [rows * length]
    bounds = {
        "starts": starts,
        "cu_seqlens": torch.tensor(flat, dtype=torch.int32, device=position_ids.device),  # (samples + 1,)
        "max_seqlen": max(e - s for s, e in zip(flat, flat[1:])),
    }
    return bounds


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
    # The forward's caller passes the boundaries once for every layer (lib/head.py); else each layer finds them.
    bounds = packed_bounds or sequence_bounds(position_ids, rows, length)
    device = query.device.type
    if torch.is_autocast_enabled(device):
        # Autocast casts matmul inputs, not attention's: Qwen3's q/k norms and RoPE leave q and k in float32
        # (the master weights' dtype) while v comes out of a projection in bf16.
        dtype = torch.get_autocast_dtype(device)
        query, key, value = (x.to(dtype) for x in (query, key, value))
    # The flash kernels take half precision only (bf16 under autocast); fp32 on CUDA takes the SDPA loop.
    half = query.dtype in (torch.float16, torch.bfloat16)
    kernel = varlen_kernel() if device in VARLEN_DEVICES and half else None
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
        pieces = [
            sample_attention(
                query[row : row + 1, :, s:e],
                key[row : row + 1, :, s:e],
                value[row : row + 1, :, s:e],
                scaling,
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


def sample_attention(query, key, value, scaling):
    """Causal attention within one sample: (1, heads, L, D) and (1, kv heads, L, D) -> (1, heads, L, D)."""
    import torch
    import torch.nn.functional as F

    length = query.shape[2]
    if query.device.type == "cpu" and query.dtype == torch.bfloat16 and length <= SHORT_SAMPLE:
        causal = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
        return float32_attention(query, key, value, causal[None, None], scaling)
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)


def float32_attention(query, key, value, mask=None, scaling=None):
    """Attention as two matmuls in float32, each key/value head's query heads taken together (no copies of
    the grouped heads): query (B, heads, Q, D), key and value (B, kv heads, T, D), mask None or (B or 1, 1, Q,
    T), bool (True attends) or additive -> (B, heads, Q, D) in query's dtype. On a CPU, SDPA's kernel took
    4-5x longer for a decode step (64 rows of SmolLM2, bf16) and ~1.5x for a short sample's causal forward and
    backward; float32 scores keep it as close to a float64 reference as SDPA (tests/test_engine.py)."""
    import torch

    batch, heads, length, dim = query.shape
    groups, keys = key.shape[1], key.shape[2]
    per_group = heads // groups
    with torch.autocast(query.device.type, enabled=False):  # float32 even inside a bf16 autocast region
        grouped = query.float().reshape(batch, groups, per_group * length, dim)  # rows: (head, query)
        scale = dim**-0.5 if scaling is None else scaling
        scores = (grouped @ key.float().transpose(-1, -2) * scale).view(
            batch, groups, per_group, length, keys
        )
        if mask is not None:
            mask = mask[..., :keys].unsqueeze(1)  # (B or 1, 1, 1, Q, T)
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        weights = scores.softmax(dim=-1).view(batch, groups, per_group * length, keys)
        out = weights @ value.float()  # (B, kv, heads per kv x Q, D)
    return out.view(batch, heads, length, dim).to(query.dtype)
