"""SFT data: conversations from a taskset, a JSONL file or a Hugging Face dataset, tokenized and packed into rows."""

import functools
import json
import random
from pathlib import Path

from lib.config import UserError

IGNORE = -100  # target of a token that carries no loss (prompt, padding, sample boundary)

# A tokenized sample: token ids and a 0/1 mask of the tokens the model learns to produce.
Sample = tuple[list[int], list[int]]


# ---------------------------------------------------------------- conversations


def _as_messages(value, role: str) -> list[dict]:
    """A `prompt` / `completion` column: either plain text (one message of `role`) or a list of messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return list(value)


def to_messages(row: dict) -> list[dict]:
    """One record (`messages`, or `prompt` + `completion`) as a list of {role, content} messages."""
    if "messages" in row:
        messages = list(row["messages"])
    elif "prompt" in row and "completion" in row:
        messages = _as_messages(row["prompt"], "user") + _as_messages(row["completion"], "assistant")
    else:
        raise UserError(f"a data record needs `messages` or `prompt` + `completion`, got keys {sorted(row)}.")
    # Datasets add columns such as tool_calls=None that chat templates would render: keep the text, and
    # the tool-call fields only where they are set.
    keep = ("tool_calls", "tool_call_id")
    return [
        {"role": m["role"], "content": m["content"], **{key: m[key] for key in keep if m.get(key)}}
        for m in messages
    ]


def with_tools(row: dict, messages: list[dict]) -> list[dict] | dict:
    """A conversation: its messages, or {"messages", "tools"} when the record offers tools (a `tools` column)."""
    return {"messages": messages, "tools": row["tools"]} if row.get("tools") else messages


def load_conversations(env) -> list[list[dict] | dict]:
    """Conversations from `env.id`: a .jsonl path, a Hugging Face dataset id (has a `/`), or a taskset id.

    A conversation is its list of messages, or {"messages": [...], "tools": [...]} when it offers tools.
    """
    source = env.id
    if source.endswith(".jsonl"):
        path = Path(source)
        if not path.is_file():
            raise UserError(f"data file {source} does not exist.")
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        rows = [json.loads(line) for line in lines]
        conversations = [with_tools(row, to_messages(row)) for row in rows]
    elif "/" in source:
        import datasets

        try:
            rows = datasets.load_dataset(source, split="train")
        except ConnectionError:  # datasets' answer when the hub is unreachable and nothing is cached
            raise UserError(
                f"could not reach the Hugging Face hub for {source}: give a local .jsonl instead."
            ) from None
        conversations = [with_tools(row, to_messages(row)) for row in rows]
    else:
        from lib.tasks import sft_conversations

        conversations = sft_conversations(env)
    if env.num_examples > 0:
        conversations = conversations[: env.num_examples]
    if not conversations:
        raise UserError(f"data source {source} gave no conversations.")
    return conversations


# ---------------------------------------------------------------- tokenization


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False, tools=None) -> list[int]:
    encoded = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True
    )
    return list(encoded["input_ids"])


def tokenize_conversation(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[Sample]:
    """Token ids plus a mask of the assistant tokens, rendered through the tokenizer's chat template.

    Each assistant turn is located by rendering the conversation up to it with the generation prompt
    (not trained) and then with the turn itself (trained, through the end-of-turn token). When the
    template renders every turn as a growing prefix, the whole conversation is one sample; templates
    that rewrite earlier turns (Qwen3 drops old reasoning) give one sample per assistant turn, each in
    exactly the context the model sees when it produces that turn. Tool results (role "tool") are
    context, as user turns are; `tools` are the tools offered, rendered as the template does.
    """
    turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if not turns:
        raise UserError("a conversation has no assistant message to learn from.")
    spans = []
    for i in turns:
        prompt = render(tokenizer, messages[:i], add_generation_prompt=True, tools=tools)
        full = render(tokenizer, messages[: i + 1], tools=tools)
        if full[: len(prompt)] != prompt:
            raise UserError(
                "the chat template does not render an assistant turn after its generation prompt."
            )
        reply = full[len(prompt) :]
        # Template text after the end-of-turn token (Qwen: a newline) is never generated: no loss on it.
        if tokenizer.eos_token_id in reply:
            end = len(prompt) + len(reply) - reply[::-1].index(tokenizer.eos_token_id)
        else:
            end = len(full)
        spans.append((prompt, full, end))

    whole = spans[-1][1]
    if all(whole[: len(full)] == full for _, full, _ in spans):
        mask = [0] * len(whole)
        for prompt, _, end in spans:
            mask[len(prompt) : end] = [1] * (end - len(prompt))
        return [(whole, mask)]
    return [
        (full, [0] * len(prompt) + [1] * (end - len(prompt)) + [0] * (len(full) - end))
        for prompt, full, end in spans
    ]


def tokenize_all(tokenizer, conversations: list, seq_len: int) -> tuple[list[Sample], int]:
    """Every conversation's samples, cut to seq_len tokens; also returns how many were cut."""
    samples, truncated = [], 0
    for conversation in conversations:
        if isinstance(conversation, dict):
            messages, tools = conversation["messages"], conversation.get("tools")
        else:
            messages, tools = conversation, None
        for ids, mask in tokenize_conversation(tokenizer, messages, tools):
            truncated += len(ids) > seq_len
            samples.append((ids[:seq_len], mask[:seq_len]))
    return samples, truncated


# ---------------------------------------------------------------- order and rows


@functools.lru_cache(maxsize=2)
def epoch_order(num_samples: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(num_samples))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)


def batch_indices(step: int, batch_size: int, num_samples: int, seed: int) -> list[int]:
    """The samples of optimizer step `step`: a fixed stream of seeded per-epoch shuffles, so the step
    alone fixes the data position (resume needs nothing else)."""
    indices = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, num_samples)
        indices.append(epoch_order(num_samples, seed, epoch)[offset])
    return indices


def pack(lengths: list[int], seq_len: int) -> list[list[int]]:
    """First-fit decreasing: sample indices grouped into rows of at most seq_len tokens (SFT and RL)."""
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


def make_rows(samples: list[Sample], seq_len: int, packing: bool, pad_id: int):
    """Input ids, position ids and next-token targets, each (rows, length), padded on the right.

    Packed rows hold several samples whose positions restart at 0; transformers reads the restarts as
    sample boundaries and masks attention across them (no attention_mask is passed). A sample's last
    token gets no target, so nothing is learnt across a boundary.
    """
    import torch

    groups = (
        pack([len(ids) for ids, _ in samples], seq_len) if packing else [[i] for i in range(len(samples))]
    )
    rows = []
    for group in groups:
        input_ids, positions, targets = [], [], []
        for i in group:
            ids, mask = samples[i]
            input_ids += ids
            positions += range(len(ids))
            targets += [ids[t + 1] if mask[t + 1] else IGNORE for t in range(len(ids) - 1)] + [IGNORE]
        rows.append((input_ids, positions, targets))
    length = max(len(ids) for ids, _, _ in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    # Padding continues the last position, so it reads as the same sequence: causal attention keeps
    # real tokens from seeing it, and unpacked rows stay plain causal (no mask needed).
    position_ids = torch.arange(length).repeat(len(rows), 1)
    targets = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    for r, (ids, positions, row_targets) in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        position_ids[r, : len(ids)] = torch.tensor(positions)
        position_ids[r, len(ids) :] += positions[-1] + 1 - len(ids)
        targets[r, : len(ids)] = torch.tensor(row_targets)
    return input_ids, position_ids, targets


# ---------------------------------------------------------------- attention over packed rows


# The boundaries of the forward in progress: every layer gets the same position_ids tensor, so they are
# found once per forward (one host sync), not once per layer. Holding the tensor keeps `is` reliable.
_bounds_cache: list = [None, None]


def sequence_bounds(position_ids, rows: int, length: int) -> dict:
    """Where the samples of each packed row start, from the restarts of position_ids (B or 1, L): per-row
    start lists, the samples' int32 offsets in the flattened (B * L) batch and the longest sample."""
    import torch

    if _bounds_cache[0] is position_ids:
        return _bounds_cache[1]
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
    _bounds_cache[:] = [position_ids, bounds]
    return bounds


def varlen_kernel():
    """(name, function) of flash-attn's variable-length kernel when installed, else torch's."""
    import importlib.util

    if importlib.util.find_spec("flash_attn"):
        from flash_attn import flash_attn_varlen_func

        return "flash_attn", flash_attn_varlen_func
    from torch.nn.attention import varlen  # torch >= 2.10 (the lock pins 2.13)

    return "torch", varlen.varlen_attn


def packed_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, position_ids=None, **kwargs
):
    """Causal attention inside each sample of a packed row, as a transformers attention function.

    SDPA with transformers' block-diagonal mask computes every row_length^2 score and masks most of
    them. On CUDA a variable-length kernel (flash-attn's, or torch's) attends within each sample of the
    flattened batch in one call; elsewhere one causal SDPA call per sample costs the sum of the
    samples' length^2. Samples start where position ids restart (the convention of make_rows).
    """
    import torch
    import torch.nn.functional as F

    assert attention_mask is None and dropout == 0.0, "packed attention takes neither a mask nor dropout"
    rows, heads, length, dim = query.shape  # query (B, H, L, D); key, value (B, KV heads, L, D)
    if position_ids is None:
        position_ids = torch.arange(length, device=query.device)[None]  # (1, L): one sample per row
    bounds = sequence_bounds(position_ids, rows, length)
    # The flash kernels take half precision only (bf16 under autocast); fp32 on CUDA takes the SDPA loop.
    kernel = varlen_kernel() if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) else None
    if kernel is not None:
        # Flattened (B * L, heads, D): a sample never spans two rows, so the row ends are sample ends too.
        q, k, v = (x.transpose(1, 2).reshape(rows * length, x.shape[1], dim) for x in (query, key, value))
        cu, longest = bounds["cu_seqlens"], bounds["max_seqlen"]
        name, attend = kernel
        if name == "flash_attn":
            out = attend(q, k, v, cu, cu, longest, longest, softmax_scale=scaling, causal=True)
        else:  # window (-1, 0): causal
            out = attend(
                q, k, v, cu, cu, longest, longest, scale=scaling, window_size=(-1, 0), enable_gqa=True
            )
        return out.reshape(rows, length, heads, dim), None  # (B, L, H, D)
    out = []
    for row, row_starts in enumerate(bounds["starts"]):
        edges = [*row_starts, length]
        pieces = [
            F.scaled_dot_product_attention(
                query[row : row + 1, :, s:e],
                key[row : row + 1, :, s:e],
                value[row : row + 1, :, s:e],
                is_causal=True,
                scale=scaling,
                enable_gqa=True,
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
