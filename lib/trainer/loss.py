"""The policy loss: importance-sampled, over whole rollouts in packed rows, normalised over the whole step."""

import dataclasses
import math
from typing import Literal

from lib.config import UserError


@dataclasses.dataclass
class LossConfig:
    variant: Literal["dppo", "ppo", "cispo", "reinforce"] = "dppo"
    """dppo (default): -ratio * adv, masking tokens whose probability moved too far (arXiv:2602.04879);
    ppo: -min(ratio * adv, clip(ratio) * adv) (arXiv:1707.06347);
    cispo: -sg(min(ratio, 1 + clip_high)) * adv * logp (MiniMax-M1, arXiv:2506.13585);
    reinforce: -adv * logp, no ratio (on-policy). ratio = p_train / p_inference; more in lib/trainer/loss.py."""
    mask_threshold: float = 0.2
    """dppo: mask a token when its probability moved more than this from the inference policy toward adv."""
    log_ratio_coef: float = 1e-3
    """dppo: weight of the (log ratio)^2 penalty."""
    clip_low: float = 0.2
    """ppo: lower clip, ratio >= 1 - clip_low."""
    clip_high: float = 0.28
    """ppo: upper clip, ratio <= 1 + clip_high (above clip_low = DAPO's clip-higher);
    cispo: the weight's cap, min(ratio, 1 + clip_high)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """ppo and cispo's ratio. token: each token's own;
    sequence: the rollout's exp(mean log ratio over its loss tokens) (GSPO, arXiv:2507.18071; clip 3e-4/4e-4)."""
    aggregation: Literal["token_mean", "sequence_mean", "constant"] = "token_mean"
    """How per-token losses add up to the step's loss.
    token_mean: their sum / the step's loss tokens (DAPO, arXiv:2503.14476);
    sequence_mean: the mean over the step's rollouts of each one's token mean (GRPO, arXiv:2402.03300);
    constant: their sum / (examples_per_step x rollouts_per_example x sampling.max_tokens) (Dr. GRPO);
    max_tokens is per turn, so a multi-turn rollout may hold more than its share (arXiv:2503.20783)."""
    mismatch_correction: Literal["none", "truncate", "mask"] = "none"
    """Trainer/inference mismatch, for a token whose weight w = p_train / p_inference is above mismatch_cap.
    truncate (TIS, Yao et al. 2025): the variant's own weight with w replaced by min(w, cap), e.g. cispo's
    min(w, cap, 1 + clip_high); w is the variant's ratio, so mismatch_level must equal ratio_level;
    mask (MIS): it carries no loss. Logged as mismatch_truncated / mismatch_masked.
    reinforce, which weighs by no ratio, is weighted by min(w, cap), or by w and 0 above the cap (either level)."""
    mismatch_level: Literal["token", "sequence"] = "token"
    """mismatch_correction's w. token: each token's own;
    sequence: its rollout's, exp(sum of the rollout's log ratios), on all its tokens (truncated, GSPO's
    exp(mean log ratio) becomes min(w, cap) ** (1 / the rollout's loss tokens))."""
    mismatch_cap: float = 3.0
    """The cap of mismatch_correction (TRL's default)."""
    mask_truncated: bool = False
    """Rollouts cut by a token limit carry no loss (DAPO's overlong masking, arXiv:2503.14476).
    Cut: a turn of it ended at max_tokens, or at what seq_len left it; it still counts in its group's mean."""
    kl_coef: float = 0.0
    """Weight of a KL penalty toward the reference model, the run's starting weights (0 = off, no reference
    is loaded; 0.001-0.05 in the peers). Under LoRA the reference is the model with the adapter off."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """The penalty's per-token KL estimate, log r = logp - ref_logp: k1 = log r;
    k3 = exp(-log r) - 1 + log r, >= 0 (Schulman 2020). Logged as ref_kl, with the same estimator."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus (0 = off): minus this times the entropy of each loss token's distribution."""
    import_path: str = ""
    """package.module:function, a loss to use instead of lib/trainer/loss.py's policy_loss, imported from the Python path
    or the working directory. Called with the same arguments (per-token tensors, rollout index, step counts);
    returns (loss, metrics)."""

    def __post_init__(self):
        if not 0 < self.mask_threshold <= 1:
            raise UserError("loss.mask_threshold must be in (0, 1].")
        if self.log_ratio_coef < 0 or self.clip_low <= 0 or self.clip_high <= 0:
            raise UserError("loss.log_ratio_coef must be >= 0 and loss.clip_low/clip_high > 0.")
        if self.clip_low >= 1:
            raise UserError("loss.clip_low must be below 1 (the ratio's lower clip is 1 - clip_low).")
        if self.ratio_level == "sequence" and self.variant not in ("ppo", "cispo"):
            raise UserError("loss.ratio_level sequence applies to loss.variant ppo (GSPO) or cispo only.")
        # Truncation replaces the variant's ratio by the capped w: both must be of the same tokens (or rollout).
        truncated = self.mismatch_correction == "truncate" and self.variant != "reinforce"
        if truncated and self.mismatch_level != self.ratio_level:
            raise UserError(
                "loss.mismatch_correction truncate caps the variant's own ratio, so loss.mismatch_level must "
                f"equal loss.ratio_level ({self.ratio_level} here; reinforce takes either level)."
            )
        if self.mismatch_cap < 1:
            raise UserError("loss.mismatch_cap must be >= 1 (a lower cap would correct on-policy tokens).")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise UserError("loss.kl_coef and loss.entropy_coef must be >= 0.")
        if self.import_path and self.import_path.count(":") != 1:
            raise UserError("loss.import_path must read package.module:function.")
        if self.import_path:
            import_loss(self.import_path)  # a path that names no function fails here, before any model loads


@dataclasses.dataclass
class DistillConfig:
    reward_weight: float = 0.0
    """On-policy distillation (--teacher.*): the weight of the environment's reward advantage beside the
    teacher's per-token one (0 = pure distillation: the reward is logged, not trained on)."""

    def __post_init__(self):
        if self.reward_weight < 0:
            raise UserError("distill.reward_weight must be >= 0.")


# Everything below runs in the trainer; torch is imported lazily so `--help` stays fast.


def token_logp(logits, input_ids, temperature: float = 1.0, mask=None):
    """log p(token t | tokens < t), aligned with input_ids; position 0 (and any position off `mask`) gets 0.

    logits: (B, T, V) from the model on input_ids (B, T). The logits are divided by the sampling
    temperature first, because the inference logprobs are those of the distribution actually sampled
    from; without it the ratio at temperature != 1 would not be 1 on-policy.
    `mask` (B, T), when given, limits the work to those tokens. Training does not take this path: it scores
    tokens through lib/trainer/head.py, chunk by chunk, without logits over the vocabulary; the sync probe (a few
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

    The plain definition that lib/trainer/head.py's chunked entropy (rl.py's metric) is tested against: computed
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


def distill_advantages(adv, logp, teacher_logp, loss_mask, reward_weight: float):
    """On-policy distillation's per-token advantage and the reverse KL it lowers, (B, T) each.

    adv = reward_weight * the reward's advantage + (teacher_logp - logp), with logp the trainer's (detached):
    through the policy loss, whose importance ratio corrects for the sampler, the gradient is the reverse
    KL's, E_p[(log p - log q) grad log p], on the tokens the student sampled (Agarwal et al. 2024,
    arXiv:2306.13649; Lu & Thinking Machines 2025; prime-rl's OPD). reverse_kl = logp - teacher_logp, the
    per-token estimate of KL(student || teacher) (k1), 0 off the loss mask. The teacher's logprobs are of its
    own distribution (temperature 1: vLLM's prompt_logprobs skip the sampling processors), the student's at
    sampling.temperature, so the distribution the student samples from moves toward the teacher's.
    """
    import torch

    reverse_kl = torch.where(loss_mask, logp.detach() - teacher_logp, 0.0)  # (B, T)
    return reward_weight * adv - reverse_kl, reverse_kl  # (B, T), (B, T)


def token_share(values, loss_mask, num_loss_tokens):
    """This micro-batch's share of the step-wide token mean of `values` (B, T) -> ().

    Summing the shares over every micro-batch and every rank gives the mean over all loss tokens of
    the step, exactly as for the loss below.
    """
    import torch

    return torch.where(loss_mask, values, 0).sum() / num_loss_tokens  # ()


def rollout_sums(values, rollout_index, loss_mask):
    """Each token's rollout's sum of `values` over its loss tokens, (B, T) -> (B, T), with gradient.

    Packing keeps every rollout whole, in one row of one micro-batch (lib/trainer/packing.py), so the sum over a
    rollout is complete in the micro-batch that holds it.
    """
    import torch

    segments, inverse = torch.unique(rollout_index, return_inverse=True)  # (S,), (B, T)
    masked = torch.where(loss_mask, values, 0.0).flatten()  # (B * T,)
    sums = torch.zeros(len(segments), dtype=values.dtype, device=values.device)  # (S,)
    return sums.index_add(0, inverse.flatten(), masked)[inverse]  # (B, T)


def policy_loss(
    logp,
    inference_logp,
    adv,
    loss_mask,
    num_loss_tokens,
    config: LossConfig,
    rollout_index=None,
    num_rollouts=None,
    num_episodes=None,
    num_budget_tokens=None,
    ref_logp=None,
    token_entropy=None,
):
    """Policy-gradient loss of one micro-batch, and its metrics; a custom loss (loss.import_path) takes the same.

    Per token, (B, T): logp from the trainer (with grad), inference_logp from the server that sampled the tokens,
    adv the rollout's advantage, loss_mask True on sampled tokens, rollout_index the rollout's index in the step
    (None: one rollout per row). The counts are the WHOLE step's, over micro-batches and ranks: loss tokens,
    rollouts, episodes (an episode's branches count once) and Dr. GRPO's token budget. The loss is this
    micro-batch's share of the step's, so gradient accumulation adds up to one big batch (FSDP averages over
    ranks: scale it by the world size). Variants, with ratio = p_train / p_inference: dppo (default; Qi et al.
    2026, arXiv:2602.04879), ppo (Schulman et al. 2017, arXiv:1707.06347, with DAPO's clip-higher), cispo
    (MiniMax-M1, arXiv:2506.13585), reinforce (Williams 1992). Each formula and option is written out where it
    applies. ref_logp (B, T): the reference model's logprobs of the tokens (no grad; rl.py passes them when
    loss.kl_coef > 0), token_entropy (B, T): each token's distribution's entropy, with grad (loss.entropy_coef).
    Returns (loss, metrics): detached shares of step-wide token means, summed like the loss.
    """
    import torch

    assert logp.shape == inference_logp.shape == adv.shape == loss_mask.shape, (
        "per-token inputs differ in shape"
    )
    assert float(num_loss_tokens) > 0, "a step with no loss tokens has nothing to normalise by"
    loss_mask = loss_mask.bool()
    if rollout_index is None:
        rollout_index = torch.arange(logp.shape[0], device=logp.device)[:, None].expand(logp.shape)  # (B, T)

    # Off the loss mask the inference logp may be a placeholder (prompt tokens have none): force the
    # log ratio to 0 there so exp() never overflows into inf * 0 = nan.
    log_ratio = torch.where(loss_mask, logp - inference_logp, 0.0)  # (B, T)
    token_ratio = torch.exp(log_ratio)  # (B, T)

    def rollout_tokens():
        """Each token's rollout's number of loss tokens, (B, T) (at least 1, padding included)."""
        return rollout_sums(loss_mask.to(logp.dtype), rollout_index, loss_mask).clamp(min=1)

    # Trainer/inference mismatch correction: w is the importance weight of the token, or of its whole rollout
    # (the product of its tokens' ratios, the sequence's likelihood ratio), both detached.
    excess = 0.0
    if config.mismatch_correction != "none":
        if config.mismatch_level == "token":
            log_weight = log_ratio.detach()  # (B, T)
        elif config.mismatch_level == "sequence":
            log_weight = rollout_sums(log_ratio.detach(), rollout_index, loss_mask)  # (B, T)
        else:
            raise UserError(
                f"unknown loss.mismatch_level {config.mismatch_level!r} (choose token or sequence)."
            )
        weight = torch.exp(log_weight)  # (B, T)
        over_cap = loss_mask & (weight > config.mismatch_cap)  # (B, T)
        if config.mismatch_correction == "truncate":
            # Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you
            # off-policy RL training"): the variant's own weight with w replaced by min(w, cap). w is the
            # variant's ratio (LossConfig refuses mixed levels), so the log ratios it sees are lowered by
            # log(w / cap) above the cap, detached: the ratio's value and its gradient's weight are then the
            # capped ones, and clips (ppo's, cispo's) act on the capped ratio; dppo's trust-region mask and its
            # log-ratio penalty keep the true ones. Scaling the loss by cap / w instead would shrink cispo's
            # already clipped weight: min(w, 1 + clip_high) * cap / w.
            excess = torch.where(over_cap, log_weight - math.log(config.mismatch_cap), 0.0)  # (B, T)

    if config.ratio_level == "token":
        ratio = torch.exp(log_ratio - excess)  # (B, T)
    elif config.ratio_level == "sequence":
        # GSPO: s_i = exp((1 / |y_i|) sum_t log ratio_t), the same on every token of rollout i, with the gradient
        # s_i / |y_i| * grad logp_t on each (Zheng et al. 2025, arXiv:2507.18071). Truncated, the sum is
        # lowered to log min(w_i, cap), with w_i = exp(sum_t log ratio_t).
        log_sum = rollout_sums(log_ratio, rollout_index, loss_mask) - excess  # (B, T)
        ratio = torch.exp(log_sum / rollout_tokens())  # (B, T)
    else:
        raise UserError(f"unknown loss.ratio_level {config.ratio_level!r} (choose token or sequence).")

    if config.variant == "dppo":
        # -ratio * adv on tokens inside the trust region + log_ratio_coef * log(ratio)^2: a token leaves the
        # region when its probability moved more than mask_threshold in the direction its advantage pushes.
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
        # -min(ratio * adv, clip(ratio, 1 - clip_low, 1 + clip_high) * adv), summed over tokens as DAPO does.
        # Deviation from PPO: the "old" policy is the inference policy itself (one update per batch, no
        # recomputed old logprobs), so the clip also bounds the trainer/inference mismatch and staleness.
        clipped_ratio = ratio.clamp(1 - config.clip_low, 1 + config.clip_high)  # (B, T)
        per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)  # (B, T)
        # Tokens where the clipped branch wins carry no gradient.
        masked = ((adv > 0) & (ratio > 1 + config.clip_high)) | ((adv < 0) & (ratio < 1 - config.clip_low))
    elif config.variant == "cispo":
        # -sg(min(ratio, 1 + clip_high)) * adv * logp: the weight is clipped and detached, so a clipped token
        # still carries a gradient, where PPO's clip drops it (MiniMax-M1). Deviation: no lower clip, as
        # the paper's runs set epsilon_low out of reach.
        weight = ratio.detach().clamp(max=1 + config.clip_high)  # (B, T)
        per_token = -weight * adv * logp  # (B, T)
        masked = ratio.detach() > 1 + config.clip_high  # (B, T): clipped, not dropped
    elif config.variant == "reinforce":
        # Deviation from importance sampling: the ratio is ignored, assuming the samples are on-policy;
        # with max_async_level > 0 or a trainer/inference mismatch the gradient is biased (see mismatch_kl),
        # unless mismatch_correction weighs it.
        per_token = -adv * logp  # (B, T)
        masked = torch.zeros_like(loss_mask)  # (B, T)
    else:
        raise UserError(f"unknown loss.variant {config.variant!r} (choose dppo, ppo, cispo or reinforce).")

    if config.mismatch_correction == "none":
        pass
    elif config.mismatch_correction == "truncate":
        # The other variants weighed by the capped ratio above; reinforce, which weighs by none, takes min(w, cap).
        if config.variant == "reinforce":
            per_token = per_token * weight.clamp(max=config.mismatch_cap)  # (B, T)
    elif config.mismatch_correction == "mask":
        # Masked importance sampling: a token (a rollout, at sequence level) whose weight is above the cap
        # carries no loss (TRL's token_mask / sequence_mask); reinforce's others are weighted by w.
        if config.variant == "reinforce":
            per_token = per_token * torch.where(over_cap, 0.0, weight)  # (B, T)
        else:
            per_token = torch.where(over_cap, 0.0, per_token)  # (B, T)
    else:
        raise UserError(
            f"unknown loss.mismatch_correction {config.mismatch_correction!r} (choose none, truncate or mask)."
        )

    # KL to the reference model, per token, added to the loss before the aggregation as TRL, verl and SkyRL do
    # (after the mismatch correction, which weighs the policy gradient, not the penalty). log r = logp -
    # ref_logp; the tokens were sampled by the inference policy and the estimate is not reweighted to the
    # trainer's (a deviation, shared with the peers, as small as the ratio is close to 1). Gradients: k3's is
    # (1 - ref / p) * grad logp, whose mean under p is the gradient of KL(ref || p); k1's is grad logp, whose
    # mean under p is 0: as a loss k1 pulls only through off-policy tokens (Tang & Munos 2025,
    # arXiv:2506.09477). k1 is here because the peers offer it; k3 is the default.
    if ref_logp is not None:
        ref_log_ratio = torch.where(loss_mask, logp - ref_logp, 0.0)  # (B, T)
        if config.kl_estimator == "k1":
            ref_kl = ref_log_ratio  # (B, T)
        elif config.kl_estimator == "k3":
            ref_kl = torch.exp(-ref_log_ratio) - 1 + ref_log_ratio  # (B, T)
        else:
            raise UserError(f"unknown loss.kl_estimator {config.kl_estimator!r} (choose k1 or k3).")
        per_token = per_token + config.kl_coef * ref_kl  # (B, T)
    else:
        assert not config.kl_coef, "loss.kl_coef > 0 needs the reference model's logprobs (ref_logp)"
    # Entropy bonus: -entropy_coef x the entropy of each loss token's next-token distribution (verl's
    # entropy_coeff, aggregated like the policy loss), its gradient through lib/trainer/head.py's backward.
    if config.entropy_coef:
        assert token_entropy is not None, "loss.entropy_coef > 0 needs each token's entropy (token_entropy)"
        per_token = per_token - config.entropy_coef * token_entropy  # (B, T)

    if config.aggregation == "token_mean":
        # sum_t loss_t / (loss tokens of the whole step): every token weighs the same, however long its rollout
        # (DAPO's token-level normalisation), over the step, not per micro-batch.
        loss = token_share(per_token, loss_mask, num_loss_tokens)  # ()
    elif config.aggregation == "sequence_mean":
        # (1 / N) sum_i (1 / |y_i|) sum_t loss_i,t over the step's N rollouts: every rollout weighs the same,
        # however long (GRPO as published, Shao et al. 2024, eq. 3; verl's seq-mean-token-mean).
        assert num_rollouts, "aggregation sequence_mean needs the step's number of rollouts"
        loss = token_share(per_token / rollout_tokens(), loss_mask, num_rollouts)  # ()
    elif config.aggregation == "constant":
        # sum_t loss_t / (examples_per_step x rollouts_per_example x max_tokens): a constant divisor, so no
        # rollout's tokens weigh more for being in a short rollout or a short step (Dr. GRPO, Liu et al. 2025).
        assert num_budget_tokens, "aggregation constant needs the step's token budget"
        loss = token_share(per_token, loss_mask, num_budget_tokens)  # ()
    else:
        raise UserError(
            f"unknown loss.aggregation {config.aggregation!r} (choose token_mean, sequence_mean or constant)."
        )

    with torch.no_grad():
        # k3 estimator of KL(inference || trainer) per token, unbiased under tokens sampled by inference:
        # E_q[r - 1 - log r] = KL(q || p) with r = p / q. Schulman (2020), "Approximating KL divergence".
        mismatch_kl = token_ratio - 1 - log_ratio  # (B, T)
        metrics = {
            "importance_ratio": token_share(token_ratio, loss_mask, num_loss_tokens),
            "mismatch_kl": token_share(mismatch_kl, loss_mask, num_loss_tokens),
            "masked_fraction": token_share(masked.float(), loss_mask, num_loss_tokens),
            "advantage": token_share(adv.float(), loss_mask, num_loss_tokens),
            "logp": token_share(logp.detach(), loss_mask, num_loss_tokens),
        }
        if ref_logp is not None:
            metrics["ref_kl"] = token_share(ref_kl, loss_mask, num_loss_tokens)
        if config.mismatch_correction != "none":
            # Loss tokens whose weight was above the cap: truncated, or masked.
            name = f"mismatch_{'truncated' if config.mismatch_correction == 'truncate' else 'masked'}"
            metrics[name] = token_share(over_cap.float(), loss_mask, num_loss_tokens)
    return loss, metrics


def loss_function(config: LossConfig):
    """policy_loss, or the function that config.import_path names (package.module:function): a custom loss takes
    policy_loss's arguments, by the same names, and returns (loss, metrics) the same way."""
    return import_loss(config.import_path) if config.import_path else policy_loss


def import_loss(import_path: str):
    """The function `import_path` (package.module:function) names, from the Python path or the working directory."""
    import importlib
    import os
    import sys

    module_name, _, function_name = import_path.partition(":")
    # `python scripts/rl.py` puts scripts/ on the path, not the directory it runs in. Appended, not prepended:
    # a file there never hides an installed package from the imports that come later.
    here = os.getcwd()
    if here not in sys.path:
        sys.path.append(here)
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise UserError(
            f"loss.import_path: cannot import {module_name} from the Python path or {here} ({error})."
        ) from None
    if not callable(getattr(module, function_name, None)):
        raise UserError(f"loss.import_path: {module_name} has no function {function_name}.")
    return getattr(module, function_name)
