"""Sampling settings shared by rollouts, evaluation and the engine's defaults."""

import dataclasses
from typing import Annotated

import tyro

from lib.config import UserError


@dataclasses.dataclass
class SamplingConfig:
    temperature: float = 1.0
    """Softmax temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off). rl.py trains on each sampled token's kept set and bounds it: top_p
    < 1 with top_k -1 samples with top_k KEPT_SET_BOUND (512), as a kept set of Qwen's 151,936-token
    vocabulary could otherwise hold ~10^5 ids a token."""
    top_k: int = -1
    """Keep only the k most likely tokens, every tie at the k-th value included, as vLLM does (-1 = off)."""
    max_tokens: Annotated[int, tyro.conf.arg(aliases=("--max-tokens",))] = 128
    """Most new tokens per model turn."""
    seed: int | None = None
    """Sampling seed sent with each request (None = random)."""

    def __post_init__(self):
        if self.temperature < 0:
            raise UserError(f"sampling.temperature must be >= 0, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise UserError(f"sampling.top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k == 0 or self.top_k < -1:
            raise UserError(f"sampling.top_k must be -1 (off) or positive, got {self.top_k}.")
        if self.max_tokens < 1:
            raise UserError(f"sampling.max_tokens must be at least 1, got {self.max_tokens}.")


KEPT_SET_BOUND = 512
"""rl.py's top_k when top_p < 1 and top_k is off: the most ids a sampled token's kept set may hold (prime-rl's
bound), so kept sets on the wire and in the buffer stay small."""


def bounded(sampling: SamplingConfig) -> SamplingConfig:
    """rl.py's sampling: top_k KEPT_SET_BOUND when top_p < 1 leaves top_k off, else `sampling` unchanged."""
    if sampling.top_p < 1 and sampling.top_k < 0:
        return dataclasses.replace(sampling, top_k=KEPT_SET_BOUND)
    return sampling


def kept_mask(logits, top_k=None, top_p=None):
    """Which tokens survive top-k then top-p in each row of `logits` (n, V), float32 and already divided by the
    temperature: (n, V) bool. top_k (n,) integers (V or more = off), top_p (n,) float32 (1 = off); None skips
    the step for every row, as vLLM does when no request of its batch uses it.

    vLLM's CPU rules (vllm/v1/sample/ops/topk_topp_sampler.py, apply_top_k_top_p_pytorch): sort ascending;
    top-k keeps every logit >= the k-th largest (all ties at the k-th value); top-p takes the softmax of what
    is left and drops the positions whose ascending cumulative sum is <= 1 - p, never the last (the most
    likely token). GPU vLLM runs a Triton kernel whose boundaries may differ: there the served kept sets are
    exact and these approximate.
    """
    import torch

    # With top_k the vocabulary is not sorted (a sort of 151,936 logits costs more than the output layer on a
    # CPU). After top-k, vLLM's ascending row is -inf up to the candidates, then the candidates ascending: that
    # row is rebuilt value for value, so its softmax and cumulative sum are vLLM's to the bit. Only which of
    # several tied ids takes which place may differ, which matters where tied logits straddle the top-p
    # boundary (rare but for bf16 logits): those rows take vLLM's own steps (sorted_rule).
    if top_k is None:
        return (
            torch.ones_like(logits, dtype=torch.bool) if top_p is None else sorted_rule(logits, None, top_p)
        )
    rows, vocab = logits.shape
    k = top_k.long().clamp(1, vocab)  # (n,)
    values, ids = logits.topk(int(k.max()), dim=-1)  # (n, kmax) descending
    kth = values.gather(-1, k[:, None] - 1)  # (n, 1) the k-th largest
    width = int((logits >= kth).sum(-1).max())  # candidates: top-k and every tie at the k-th value
    if width > values.shape[-1]:
        values, ids = logits.topk(width, dim=-1)
    candidate = values >= kth  # (n, width)
    if top_p is None:
        return torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, ids, candidate)
    values = values.masked_fill(~candidate, float("-inf")).flip(-1)  # ascending, -inf first where fewer
    ids = ids.flip(-1)
    ascending = torch.full_like(logits, float("-inf"))
    ascending[:, vocab - values.shape[-1] :] = values  # (n, V): vLLM's sorted row after top-k
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)[:, vocab - values.shape[-1] :]  # (n, width)
    below = cumulative <= 1 - top_p.float()[:, None]
    below[:, -1] = False  # at least the most likely token
    keep = ~below & values.isfinite()  # (n, width)
    kept = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, ids, keep)
    lowest_kept = values.masked_fill(~keep, float("inf")).amin(-1, keepdim=True)  # (n, 1)
    straddled = (below & values.isfinite() & (values == lowest_kept)).any(-1)  # (n,) a tie cut by top-p
    if straddled.any():
        kept[straddled] = sorted_rule(logits[straddled], top_k[straddled], top_p[straddled])
    return kept


def sorted_rule(logits, top_k=None, top_p=None):
    """kept_mask by vLLM's own steps: the whole vocabulary sorted, so tied ids fall where vLLM's sort puts them."""
    import torch

    sorted_logits, order = logits.sort(dim=-1, descending=False)  # (n, V)
    kept = torch.ones_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        vocab = logits.shape[-1]
        kth = sorted_logits.gather(-1, (vocab - top_k.long()).clamp(0, vocab - 1)[:, None])  # (n, 1)
        kept = sorted_logits >= kth
        sorted_logits = sorted_logits.masked_fill(~kept, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # (n, V)
        below = cumulative <= 1 - top_p.float()[:, None]
        below[:, -1] = False  # at least the most likely token
        kept &= ~below
    return torch.zeros_like(kept).scatter_(-1, order, kept)  # back to vocabulary order
