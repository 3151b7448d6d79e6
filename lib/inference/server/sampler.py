"""The builtin engine's sampler: the distribution each row samples from (vLLM's processed logprobs, its CPU
top-k/top-p rules) and a token drawn from it with one uniform number a row."""

import torch
import torch.nn.functional as F


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Sets logits outside each row's top-k, then outside its top-p nucleus, to -inf, by vLLM's CPU rules
    (lib/sampling.py kept_mask: every tie at the k-th value kept, top-p on the ascending cumulative sum). As
    in vLLM, a step no row of the batch uses (top_k = V, top_p = 1 everywhere) is skipped for all rows."""
    from lib.sampling import kept_mask

    top_k = None if bool((top_k >= logits.shape[-1]).all()) else top_k
    top_p = None if bool((top_p >= 1).all()) else top_p
    return logits.masked_fill(~kept_mask(logits, top_k, top_p), float("-inf"))


# Tokens a span of draw's search holds.
SPAN = 256


def draw(logprobs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """A token a row from exp(logprobs) (B, V), by inverse transform: the first token whose cumulative
    probability passes the row's uniform number in [0, 1) (B,). vLLM's exponential race (argmax p / E, E ~
    Exp(1)) draws from the same distribution at one random number a token; its noise for 64 rows of SmolLM2's
    49,152 tokens took a third of a CPU decode step. Two levels: float32 sums of SPAN tokens, added in float64,
    pick a span; a float64 cumulative sum inside it picks the token at the same share of the span's mass, so
    the float32 rounding (~1e-7 of a span) spreads over its tokens in proportion, and a token of probability 0
    (filtered out) is never drawn. A float64 cumulative sum of the whole vocabulary took 1.8x as long."""
    probs = logprobs.exp()  # (B, V)
    if probs.shape[-1] % SPAN:
        probs = F.pad(probs, (0, SPAN - probs.shape[-1] % SPAN))  # zeros are never drawn
    spans = probs.unflatten(-1, (-1, SPAN))  # (B, spans, SPAN)
    cumulative = spans.sum(-1).double().cumsum_(-1)  # (B, spans): float32 sums of SPAN terms
    total = cumulative[:, -1:]  # (B, 1): 1 up to rounding
    target = torch.minimum(
        uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total))
    )  # (B, 1), < total
    span = torch.searchsorted(cumulative, target, right=True)  # (B, 1): a span of probability > 0
    before = torch.where(span > 0, cumulative.gather(-1, (span - 1).clamp(min=0)), 0.0)  # (B, 1)
    share = (target - before) / (cumulative.gather(-1, span) - before)  # (B, 1): in [0, 1]
    inside = (
        spans.gather(1, span[..., None].expand(-1, -1, SPAN)).squeeze(1).double().cumsum_(-1)
    )  # (B, SPAN)
    last = inside[:, -1:]  # (B, 1)
    at = torch.searchsorted(
        inside, torch.minimum(share * last, torch.nextafter(last, torch.zeros_like(last))), right=True
    )  # (B, 1)
    return (span * SPAN + at).squeeze(-1)  # (B,)


def processed_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, filtered: bool
) -> torch.Tensor:
    """Log-probabilities of the distribution each row samples from: logits / temperature, top-k, top-p, renormalised.

    This is vLLM's `--logprobs-mode processed_logprobs`. Greedy rows must come with temperature 1 and no
    filtering: greedy decoding has no sampling distribution, so it reports the plain softmax (the
    model's own probability of the argmax token).
    """
    scaled = logits.float()  # (B, V)
    if not bool((temperature == 1).all()):  # a pass over (B, V) that RL's temperature 1 does without
        scaled = scaled / temperature[:, None]
    if filtered:
        scaled = filter_top_k_top_p(scaled, top_k, top_p)
    return torch.log_softmax(scaled, dim=-1)
