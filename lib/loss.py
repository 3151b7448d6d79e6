"""The policy loss: importance-sampled, token-level, normalised over the whole step."""

import dataclasses
from typing import Literal

from lib.config import UserError


@dataclasses.dataclass
class LossConfig:
    variant: Literal["dppo", "ppo", "reinforce"] = "dppo"
    """dppo: mask tokens whose probability moved too far (default); ppo: clipped ratio; reinforce: on-policy."""
    mask_threshold: float = 0.2
    """dppo: mask a token when its probability moved more than this from the inference policy toward adv."""
    log_ratio_coef: float = 1e-3
    """dppo: weight of the (log ratio)^2 penalty."""
    clip_low: float = 0.2
    """ppo: lower clip, ratio >= 1 - clip_low."""
    clip_high: float = 0.28
    """ppo: upper clip, ratio <= 1 + clip_high (above clip_low = DAPO's clip-higher)."""

    def __post_init__(self):
        if not 0 < self.mask_threshold <= 1:
            raise UserError("loss.mask_threshold must be in (0, 1].")
        if self.log_ratio_coef < 0 or self.clip_low <= 0 or self.clip_high <= 0:
            raise UserError("loss.log_ratio_coef must be >= 0 and loss.clip_low/clip_high > 0.")
        if self.clip_low >= 1:
            raise UserError("loss.clip_low must be below 1 (the ratio's lower clip is 1 - clip_low).")


# Everything below runs in the trainer; torch is imported lazily so `--help` stays fast.


def token_logp(logits, input_ids, temperature: float = 1.0, mask=None):
    """log p(token t | tokens < t), aligned with input_ids; position 0 (and any position off `mask`) gets 0.

    logits: (B, T, V) from the model on input_ids (B, T). The logits are divided by the sampling
    temperature first, because the inference logprobs are those of the distribution actually sampled
    from; without it the ratio at temperature != 1 would not be 1 on-policy.
    `mask` (B, T), when given, limits the work to those tokens. Training does not take this path: it scores
    tokens through lib/head.py, chunk by chunk, without logits over the vocabulary; the sync probe (a few
    tokens) and the tests use this plain definition.
    In packed rows the first token of each sample gets a meaningless value (it is predicted from the
    previous sample); it is a prompt token, outside the loss mask.
    """
    import torch

    targets = input_ids[:, 1:]  # (B, T-1)
    keep = torch.ones_like(targets, dtype=torch.bool) if mask is None else mask[:, 1:].bool()  # (B, T-1)
    picked = logits[:, :-1][keep].float() / temperature  # (N, V), N = kept tokens
    # gather - logsumexp is log_softmax at the target without materialising a second (N, V) tensor.
    kept_logp = picked.gather(-1, targets[keep].unsqueeze(-1)).squeeze(-1) - picked.logsumexp(-1)  # (N,)
    logp = torch.zeros(targets.shape, dtype=kept_logp.dtype, device=logits.device)  # (B, T-1)
    logp[keep] = kept_logp
    return torch.nn.functional.pad(logp, (1, 0))  # (B, T)


def entropy(logits, temperature: float = 1.0, mask=None, chunk: int = 4096):
    """Entropy of the next-token distribution that produced each token, aligned like token_logp.

    The plain definition that lib/head.py's chunked entropy (rl.py's metric) is tested against: computed
    without gradient, on `mask` tokens only when given, `chunk` tokens at a time. logits: (B, T, V) -> (B, T),
    position 0 gets 0.
    """
    import torch

    with torch.no_grad():
        shape = (logits.shape[0], logits.shape[1] - 1)
        keep = (
            torch.ones(shape, dtype=torch.bool, device=logits.device) if mask is None else mask[:, 1:].bool()
        )
        picked = logits[:, :-1][keep]  # (N, V)
        values = []
        for first in range(0, picked.shape[0], chunk):
            logp = (picked[first : first + chunk].float() / temperature).log_softmax(-1)  # (n, V)
            values.append(-(logp.exp() * logp).sum(-1))  # (n,)
        ent = torch.zeros(keep.shape, dtype=torch.float32, device=logits.device)  # (B, T-1)
        ent[keep] = torch.cat(values) if values else ent.new_zeros(0)
        return torch.nn.functional.pad(ent, (1, 0))  # (B, T)


def token_share(values, loss_mask, num_loss_tokens):
    """This micro-batch's share of the step-wide token mean of `values` (B, T) -> ().

    Summing the shares over every micro-batch and every rank gives the mean over all loss tokens of
    the step, exactly as for the loss below.
    """
    import torch

    return torch.where(loss_mask, values, 0).sum() / num_loss_tokens  # ()


def policy_loss(logp, inference_logp, adv, loss_mask, num_loss_tokens, config: LossConfig):
    """Token-level policy-gradient loss of one micro-batch, and its metrics.

    All inputs are aligned per token, shape (B, T): logp from the trainer (with grad), inference_logp
    from the server that sampled the tokens, adv the sample's advantage repeated on its tokens, and
    loss_mask True on assistant-sampled tokens only. num_loss_tokens is the number of loss tokens in
    the WHOLE optimizer step (all micro-batches, all ranks), so the returned loss is this micro-batch's
    share of the step loss: summing backward() over gradient accumulation gives the same gradient as
    one big batch. Gradient averaging across ranks (FSDP2/DDP default) divides by world size: scale
    the loss by world size there, or reduce gradients with a sum.

    Variants (config.variant), with ratio = pi_train(token) / pi_inference(token):
    - dppo (default): -ratio * adv on tokens inside the trust region + log_ratio_coef * log(ratio)^2.
      Divergence Proximal Policy Optimization, Binary-TV mask: Qi et al., "Rethinking the Trust Region
      in LLM Reinforcement Learning" (2026), arXiv:2602.04879. A token leaves the trust region when its
      probability moved more than mask_threshold (absolute) in the direction its advantage pushes.
    - ppo: -min(ratio * adv, clip(ratio, 1 - clip_low, 1 + clip_high) * adv). Schulman et al., "Proximal
      Policy Optimization Algorithms" (2017), arXiv:1707.06347, with the asymmetric clip-higher and
      token-level sum of DAPO: Yu et al. (2025), arXiv:2503.14476.
    - reinforce: -adv * logp. Williams (1992), "Simple statistical gradient-following algorithms";
      with group-mean baselines it is GRPO without ratio or clipping.

    Returns (loss, metrics): loss is a 0-d tensor with grad; metrics maps names to detached 0-d tensors,
    each a share of the step-wide token mean (sum them over micro-batches and ranks, like the loss):
    importance_ratio, mismatch_kl, masked_fraction (dppo masked / ppo clipped tokens), advantage, logp.
    """
    import torch

    assert logp.shape == inference_logp.shape == adv.shape == loss_mask.shape, (
        "per-token inputs differ in shape"
    )
    assert float(num_loss_tokens) > 0, "a step with no loss tokens has nothing to normalise by"
    loss_mask = loss_mask.bool()

    # Off the loss mask the inference logp may be a placeholder (prompt tokens have none): force the
    # log ratio to 0 there so exp() never overflows into inf * 0 = nan.
    log_ratio = torch.where(loss_mask, logp - inference_logp, 0.0)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)

    if config.variant == "dppo":
        # Binary TV: the divergence of {token, everything else} is |p_train - p_inference|.
        prob_diff = (logp.exp() - inference_logp.exp()).detach()  # (B, T)
        # The paper masks when A > 0 and ratio > 1, or A < 0 and ratio < 1, with divergence > delta;
        # for the binary TV that is exactly a signed probability difference beyond the threshold.
        masked = ((adv > 0) & (prob_diff > config.mask_threshold)) | (
            (adv < 0) & (prob_diff < -config.mask_threshold)
        )  # (B, T)
        keep = loss_mask & ~masked  # (B, T)
        # Deviation from the paper: the squared log ratio on every loss token (also masked ones) is an
        # extra pull of the trainer toward the inference policy, as in prime-rl's default loss (after the
        # Kimi K2.5 report, arXiv:2602.02276).
        per_token = -torch.where(keep, ratio * adv, 0.0) + config.log_ratio_coef * log_ratio**2  # (B, T)
    elif config.variant == "ppo":
        # Deviation from PPO: the "old" policy is the inference policy itself (one update per batch, no
        # recomputed old logprobs), so the clip also bounds the trainer/inference mismatch and staleness.
        clipped_ratio = ratio.clamp(1 - config.clip_low, 1 + config.clip_high)  # (B, T)
        per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)  # (B, T)
        # Tokens where the clipped branch wins carry no gradient.
        masked = ((adv > 0) & (ratio > 1 + config.clip_high)) | ((adv < 0) & (ratio < 1 - config.clip_low))
    elif config.variant == "reinforce":
        # Deviation from importance sampling: the ratio is ignored, assuming the samples are on-policy;
        # with max_async_level > 0 or a trainer/inference mismatch the gradient is biased (see mismatch_kl).
        per_token = -adv * logp  # (B, T)
        masked = torch.zeros_like(loss_mask)  # (B, T)
    else:
        raise UserError(f"unknown loss.variant {config.variant!r} (choose dppo, ppo or reinforce).")

    # Token-level normalisation over the whole step (DAPO), not per sample or per micro-batch.
    loss = token_share(per_token, loss_mask, num_loss_tokens)  # ()

    with torch.no_grad():
        # k3 estimator of KL(inference || trainer) per token, unbiased under tokens sampled by inference:
        # E_q[r - 1 - log r] = KL(q || p) with r = p / q. Schulman (2020), "Approximating KL divergence".
        mismatch_kl = ratio - 1 - log_ratio  # (B, T)
        metrics = {
            "importance_ratio": token_share(ratio, loss_mask, num_loss_tokens),
            "mismatch_kl": token_share(mismatch_kl, loss_mask, num_loss_tokens),
            "masked_fraction": token_share(masked.float(), loss_mask, num_loss_tokens),
            "advantage": token_share(adv.float(), loss_mask, num_loss_tokens),
            "logp": token_share(logp.detach(), loss_mask, num_loss_tokens),
        }
    return loss, metrics
