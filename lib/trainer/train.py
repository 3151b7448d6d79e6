"""rl.py's forward and backward of one micro-batch: the policy's logprobs of its loss tokens, the loss over
them, the backward that adds to the step's gradient, and the step's sums of its scalars."""

import torch

from lib.trainer import head
from lib.trainer.loss import LossConfig, distill_advantages, token_share


def train_micro_batch(
    model, mb, sums: dict, *, config: LossConfig, compute_loss, counts: dict, **scoring
) -> None:
    """rl.py's forward and backward of one micro-batch `mb` (on the model's device): the policy's logprobs of
    its loss tokens (the chunked output layer, lib/trainer/head.py: no (R, T, vocabulary) logits), `compute_loss`
    over them, and the backward that adds its gradient to the step's. `sums` gathers the step's scalars
    (loss, entropy, the loss's metrics, outside_kept_set), every rank the same keys. `scoring`: temperature,
    kept (lib/trainer/head.py KeptSets or None), count_outside (the run has kept sets), reference (lib/trainer/head.py
    Reference, for kl_coef), distill (a DistillConfig when a teacher scored the rollouts, else None), autocast and
    world_size."""
    kept, world_size, num_loss_tokens = scoring["kept"], scoring["world_size"], counts["num_loss_tokens"]
    # Before the policy's forward, whose activations it would otherwise sit beside.
    ref_logp = scoring["reference"].logp(mb, kept) if config.kl_coef else None
    with scoring["autocast"]():
        logp, token_entropy = head.next_token_scores(
            model, mb.input_ids, mb.position_ids, mb.loss_mask, scoring["temperature"], kept
        )  # (R, T) each
    # A token outside the trainer's recomputed kept set has probability 0 there: it leaves the loss (the
    # inference logprob in place of the trainer's: ratio 1, no gradient) and is counted.
    outside = mb.loss_mask & logp.isneginf()  # (R, T)
    logp = torch.where(outside, mb.inference_logp, logp)  # (R, T)
    # Only what the options use reaches the loss (a custom loss may take neither). A token outside the
    # reference's recomputed kept set (probability 0 there) carries no KL.
    extra = {"token_entropy": token_entropy} if config.entropy_coef else {}
    if ref_logp is not None:
        extra["ref_logp"] = torch.where(ref_logp.isneginf(), logp.detach(), ref_logp)  # (R, T)
    adv, distill = mb.advantages, {}  # (R, T)
    if (
        scoring["distill"] is not None
    ):  # on-policy distillation: the teacher's per-token advantage beside the reward's
        assert mb.teacher_logp is not None or not mb.loss_mask.any(), "a rollout reached training unscored"
        # An empty micro-batch carries no teacher logprobs: the inference ones stand in (no loss token).
        teacher_logp = mb.inference_logp if mb.teacher_logp is None else mb.teacher_logp  # (R, T)
        adv, reverse_kl = distill_advantages(
            adv, logp, teacher_logp, mb.loss_mask, scoring["distill"].reward_weight
        )
        distill["distill/reverse_kl"] = token_share(reverse_kl, mb.loss_mask, num_loss_tokens)
    loss, metrics = compute_loss(
        logp,
        mb.inference_logp,
        adv,
        mb.loss_mask,
        config=config,
        rollout_index=mb.rollout_index,
        **counts,
        **extra,
    )
    # FSDP averages gradients over ranks; the loss is already this rank's share of the mean.
    (loss * world_size).backward()
    entropy = token_share(token_entropy, mb.loss_mask, num_loss_tokens)
    values = {"loss": loss, "entropy": entropy, **metrics, **distill}
    if scoring["count_outside"]:
        values["outside_kept_set"] = token_share(outside.float(), mb.loss_mask, num_loss_tokens)
    for name, value in values.items():
        sums[name] = sums.get(name, 0.0) + value.item()


def train_step(
    model, optimizer, scheduler, micro_batches, counts: dict, *, cfg, kept_set: str, device: str, **scoring
):
    """rl.py's optimizer step (cfg: its Config) over this rank's micro-batches: (the step's sums, summed over
    the ranks, and the learning rate). `scoring`: compute_loss, reference, distill, autocast and world_size."""
    from lib import dist
    from lib.sampling import bounded
    from lib.trainer.optim import optimizer_step

    sums, world_size = {"loss": 0.0, "entropy": 0.0}, scoring["world_size"]
    for mb in micro_batches if counts["num_loss_tokens"] else []:
        mb = mb.to(device)
        train_micro_batch(
            model, mb, sums, config=cfg.loss, counts=counts, temperature=cfg.sampling.temperature,
            count_outside=kept_set != "none", kept=head.micro_batch_kept_sets(kept_set, bounded(cfg.sampling), mb),
            **scoring,
        )  # fmt: skip
    grad_norm, lr = optimizer_step(optimizer, scheduler, cfg.optim.max_grad_norm)
    if counts["num_loss_tokens"]:
        sums["grad_norm"] = grad_norm / world_size  # every rank has the full norm; summed below
    return {name: dist.all_sum(value, device) for name, value in sorted(sums.items())}, lr
