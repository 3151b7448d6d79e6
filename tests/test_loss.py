"""Policy loss: each variant on hand-computed values, gradient direction, step-wide normalisation, masking."""

import itertools
import math
import os
import random
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from lib.config import UserError
from lib.trainer.loss import LossConfig, entropy, policy_loss, token_logp


def probs(*values):
    """Per-token probabilities -> logprobs, shape (1, T)."""
    return torch.tensor([values], dtype=torch.float64).log()


def test_dppo_hand_computed():
    # Every token was sampled at p = 0.5. The trainer now gives:
    #   t0 0.5 adv +1  ratio 1.0  keep   -> -1.0
    #   t1 0.8 adv +1  ratio 1.6  moved +0.3 toward adv: masked -> 0
    #   t2 0.6 adv +1  ratio 1.2  moved +0.1: keep -> -1.2
    #   t3 0.2 adv -1  ratio 0.4  moved -0.3 toward adv: masked -> 0
    #   t4 0.8 adv -1  ratio 1.6  moved +0.3 against adv: keep -> +1.6
    # penalty 1e-3 * (0 + ln(1.6)^2 + ln(1.2)^2 + ln(0.4)^2 + ln(1.6)^2)
    #       = 1e-3 * (0.2209034 + 0.0332412 + 0.8395887 + 0.2209034) = 0.0013146
    # loss = (-1 - 1.2 + 1.6 + 0.0013146) / 5 tokens = -0.1197371
    logp = probs(0.5, 0.8, 0.6, 0.2, 0.8).requires_grad_()
    inference_logp = probs(0.5, 0.5, 0.5, 0.5, 0.5)
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 5, dtype=torch.bool)
    loss, metrics = policy_loss(logp, inference_logp, adv, mask, 5, LossConfig())
    assert loss.item() == pytest.approx(-0.1197371, abs=1e-6)
    assert metrics["masked_fraction"].item() == pytest.approx(0.4)
    assert metrics["importance_ratio"].item() == pytest.approx((1 + 1.6 + 1.2 + 0.4 + 1.6) / 5)
    # k3: r - 1 - ln r = 0, 0.1299964, 0.0176784, 0.3162907, 0.1299964 -> mean 0.1187924
    assert metrics["mismatch_kl"].item() == pytest.approx(0.1187924, abs=1e-6)
    loss.backward()
    # d/dlogp: -adv * ratio on kept tokens, plus 2e-3 * ln(ratio) everywhere; all over 5 tokens.
    expected = [
        -1.0,
        2e-3 * math.log(1.6),
        -1.2 + 2e-3 * math.log(1.2),
        2e-3 * math.log(0.4),
        1.6 + 2e-3 * math.log(1.6),
    ]
    assert logp.grad[0].tolist() == pytest.approx([g / 5 for g in expected], abs=1e-9)


def test_dppo_threshold_and_penalty_are_configurable():
    # t1 moved +0.3: inside a 0.35 trust region, so kept: (-1 - 1.6) / 2 with no penalty.
    logp = probs(0.5, 0.8)
    loss, metrics = policy_loss(
        logp, probs(0.5, 0.5), torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), 2,
        LossConfig(mask_threshold=0.35, log_ratio_coef=0.0),
    )  # fmt: skip
    assert loss.item() == pytest.approx(-1.3)
    assert metrics["masked_fraction"].item() == 0


def test_ppo_hand_computed():
    # p_inference = 0.5; clip to [0.8, 1.28].
    #   t0 ratio 1.0 adv +1: min(1.0, 1.0) = 1.0      -> -1.0
    #   t1 ratio 1.6 adv +1: min(1.6, 1.28) = 1.28    -> -1.28 (clipped)
    #   t2 ratio 0.6 adv +1: min(0.6, 0.8) = 0.6      -> -0.6
    #   t3 ratio 1.4 adv -1: min(-1.4, -1.28) = -1.4  -> +1.4
    #   t4 ratio 0.6 adv -1: min(-0.6, -0.8) = -0.8   -> +0.8 (clipped)
    # loss = (-1 - 1.28 - 0.6 + 1.4 + 0.8) / 5 = -0.136
    logp = probs(0.5, 0.8, 0.3, 0.7, 0.3).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 5, dtype=torch.bool)
    config = LossConfig(variant="ppo", clip_low=0.2, clip_high=0.28)
    loss, metrics = policy_loss(logp, probs(0.5, 0.5, 0.5, 0.5, 0.5), adv, mask, 5, config)
    assert loss.item() == pytest.approx(-0.136)
    assert metrics["masked_fraction"].item() == pytest.approx(0.4)
    loss.backward()
    # Unclipped: d(-ratio * adv)/dlogp = -ratio * adv; clipped tokens get no gradient.
    assert logp.grad[0].tolist() == pytest.approx([-1.0 / 5, 0.0, -0.6 / 5, 1.4 / 5, 0.0])


def test_reinforce_hand_computed_ignores_the_ratio():
    # loss = -(2 * -1 + -1 * -3) / 2 = -0.5; d/dlogp = -adv / 2 = [-1, 0.5], whatever the inference logp.
    logp = torch.tensor([[-1.0, -3.0]], requires_grad=True)
    adv = torch.tensor([[2.0, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    for inference_logp in (torch.tensor([[-1.0, -3.0]]), torch.tensor([[-5.0, 0.0]])):
        logp.grad = None
        loss, metrics = policy_loss(logp, inference_logp, adv, mask, 2, LossConfig(variant="reinforce"))
        loss.backward()
        assert loss.item() == pytest.approx(-0.5)
        assert logp.grad[0].tolist() == pytest.approx([-1.0, 0.5])
        assert metrics["masked_fraction"].item() == 0


@pytest.mark.parametrize("variant", ["dppo", "ppo", "reinforce"])
def test_gradient_step_moves_probability_with_the_advantage(variant):
    # One softmax over 4 tokens; the sampled token 2 gets a positive (then negative) advantage.
    for sign in (1.0, -1.0):
        logits = torch.zeros(4, requires_grad=True)
        inference_logp = torch.log_softmax(logits.detach(), -1)[2].view(1, 1)
        logp = torch.log_softmax(logits, -1)[2].view(1, 1)  # (1, 1)
        adv = torch.tensor([[sign]])
        loss, _ = policy_loss(
            logp, inference_logp, adv, torch.ones(1, 1, dtype=torch.bool), 1, LossConfig(variant)
        )
        loss.backward()
        with torch.no_grad():
            new_p = torch.softmax(logits - 0.5 * logits.grad, -1)[2].item()
        assert (new_p - 0.25) * sign > 1e-3, f"{variant}: p moved the wrong way for adv {sign}"


@pytest.mark.parametrize("variant", ["dppo", "ppo", "reinforce"])
def test_micro_batches_add_up_to_the_whole_step(variant):
    generator = torch.Generator().manual_seed(0)
    logp = (-torch.rand(4, 6, generator=generator, dtype=torch.float64) * 2).requires_grad_()
    inference_logp = logp.detach() + 0.3 * torch.randn(4, 6, generator=generator, dtype=torch.float64)
    adv = torch.randn(4, 1, generator=generator, dtype=torch.float64).expand(4, 6)
    mask = torch.rand(4, 6, generator=generator) > 0.3
    num_loss_tokens = int(mask.sum())
    config = LossConfig(variant)

    whole, whole_metrics = policy_loss(logp, inference_logp, adv, mask, num_loss_tokens, config)
    (whole_grad,) = torch.autograd.grad(whole, logp)

    total, summed = 0.0, dict.fromkeys(whole_metrics, 0.0)
    for rows in (slice(0, 1), slice(1, 4)):  # uneven micro-batches, as packing makes them
        loss, metrics = policy_loss(
            logp[rows], inference_logp[rows], adv[rows], mask[rows], num_loss_tokens, config
        )
        loss.backward()  # gradient accumulation
        total += loss.item()
        summed = {k: summed[k] + v.item() for k, v in metrics.items()}

    assert total == pytest.approx(whole.item(), abs=1e-12)
    torch.testing.assert_close(logp.grad, whole_grad)
    assert summed == pytest.approx({k: v.item() for k, v in whole_metrics.items()})


@pytest.mark.parametrize("variant", ["dppo", "ppo", "reinforce"])
def test_tokens_off_the_loss_mask_change_nothing(variant):
    mask = torch.tensor([[False, True, True, False]])
    adv = torch.tensor([[0.0, 1.0, -0.5, 0.0]])
    inference_logp = torch.tensor([[0.0, -1.0, -2.0, 0.0]])
    logp = torch.tensor([[-2.0, -0.9, -2.2, -1.0]], requires_grad=True)
    loss, metrics = policy_loss(logp, inference_logp, adv, mask, 2, LossConfig(variant))
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0, 0] == 0 and grad[0, 3] == 0

    # Placeholder logprobs and advantages on prompt/padding positions, even absurd ones, are ignored.
    garbage_inference = torch.tensor([[-1000.0, -1.0, -2.0, 50.0]])
    garbage_adv = torch.tensor([[7.0, 1.0, -0.5, -9.0]])
    logp2 = torch.tensor([[-30.0, -0.9, -2.2, 0.0]], requires_grad=True)
    loss2, metrics2 = policy_loss(logp2, garbage_inference, garbage_adv, mask, 2, LossConfig(variant))
    (grad2,) = torch.autograd.grad(loss2, logp2)
    assert torch.isfinite(loss2) and loss2.item() == pytest.approx(loss.item())
    torch.testing.assert_close(grad2, grad)
    assert {k: v.item() for k, v in metrics2.items()} == pytest.approx(
        {k: v.item() for k, v in metrics.items()}
    )


def test_token_logp_and_entropy_align_with_input_ids():
    # Position 0 predicts token 1: logits (0, ln 3) over 2 tokens -> p = (0.25, 0.75).
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, 5.0]]])  # (1, 2, 2)
    input_ids = torch.tensor([[0, 1]])
    assert token_logp(logits, input_ids)[0].tolist() == pytest.approx([0.0, math.log(0.75)])
    # Temperature 2 divides the logits: p(1) = sqrt(3) / (1 + sqrt(3)) = 0.6339746.
    assert token_logp(logits, input_ids, temperature=2.0)[0, 1].item() == pytest.approx(math.log(0.6339746))
    # H(0.25, 0.75) = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623351
    assert entropy(logits)[0].tolist() == pytest.approx([0.0, 0.5623351], abs=1e-6)
    assert entropy(torch.zeros(1, 3, 8))[0, 1:].tolist() == pytest.approx([math.log(8)] * 2)


def test_logp_and_entropy_on_the_loss_tokens_only_equal_the_full_ones_there():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11, requires_grad=True)  # (B, T, V)
    input_ids = torch.randint(0, 11, (3, 7))
    mask = torch.rand(3, 7) < 0.4
    mask[:, 0] = False  # position 0 is never a loss token (nothing predicts it)
    full, masked = token_logp(logits, input_ids, 0.7), token_logp(logits, input_ids, 0.7, mask)
    torch.testing.assert_close(masked[mask], full[mask])
    assert masked[~mask].abs().sum() == 0
    (grad_full,) = torch.autograd.grad((full * mask).sum(), logits)
    (grad_masked,) = torch.autograd.grad(masked.sum(), logits)
    torch.testing.assert_close(grad_masked, grad_full)
    whole, part = entropy(logits, 0.7), entropy(logits, 0.7, mask, chunk=2)  # chunks of 2 tokens
    torch.testing.assert_close(part[mask], whole[mask])
    assert part[~mask].abs().sum() == 0


def test_config_rejects_bad_values():
    with pytest.raises(ValueError):
        LossConfig(mask_threshold=0)
    with pytest.raises(ValueError):
        LossConfig(clip_low=1.0)
    with pytest.raises(ValueError, match="unknown loss.variant"):
        policy_loss(
            *[torch.zeros(1, 1)] * 3, torch.ones(1, 1, dtype=torch.bool), 1, LossConfig(variant="grpo")
        )


# ---------------------------------------------------------------- variants and options over whole rollouts


def test_cispo_hand_computed_keeps_a_gradient_on_clipped_tokens():
    # p_inference 0.5, cap 1 + 0.28: ratios 1.0, 1.6, 0.6 -> detached weights 1.0, 1.28 (clipped), 0.6.
    #   -w * adv * ln p: -1 * ln 0.5 = 0.6931472, -1.28 * ln 0.8 = 0.2856237, +0.6 * ln 0.3 = -0.7223837
    # loss = 0.2563872 / 3 = 0.0854624; d/dlogp = -w * adv / 3, the clipped token's included (PPO's is 0).
    logp = probs(0.5, 0.8, 0.3).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, metrics = policy_loss(logp, probs(0.5, 0.5, 0.5), adv, mask, 3, LossConfig(variant="cispo"))
    assert loss.item() == pytest.approx(0.0854624, abs=1e-7)
    assert metrics["masked_fraction"].item() == pytest.approx(1 / 3)  # clipped, still trained
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-1 / 3, -1.28 / 3, 0.6 / 3])


def two_rollouts_in_one_row():
    """One packed row: rollout 0 (a prompt token, then 2 sampled at p 0.6, adv +1), rollout 1 (a prompt
    token, then 3 sampled at p 0.5, 0.45, 0.5, adv -1); every inference p is 0.5. The prompt tokens carry
    absurd values, which must change nothing."""
    logp = torch.tensor(
        [[-9.0, math.log(0.6), math.log(0.6), -9.0, math.log(0.5), math.log(0.45), math.log(0.5)]]
    )
    logp = logp.double().requires_grad_()
    inference_logp = torch.tensor([[50.0] + [math.log(0.5)] * 2 + [-50.0] + [math.log(0.5)] * 3]).double()
    adv = torch.tensor([[7.0, 1.0, 1.0, 7.0, -1.0, -1.0, -1.0]]).double()
    mask = torch.tensor([[False, True, True, False, True, True, True]])
    rollout_index = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    return logp, inference_logp, adv, mask, rollout_index


def test_gspo_sequence_ratio_hand_computed():
    # s_0 = exp(mean(ln 1.2, ln 1.2)) = 1.2 > 1 + 0.1 with adv > 0: clipped to 1.1 on both tokens, no gradient.
    # s_1 = exp((ln 1 + ln 0.9 + ln 1) / 3) = 0.9^(1/3) = 0.9654894, inside [0.9, 1.1]: -adv * s_1 = 0.9654894.
    # sequence_mean over the step's 2 rollouts: (-1.1 + 0.9654894) / 2 = -0.0672553. Rollout 1's term is s_1 / 2,
    # and d s_1 / d logp_t = s_1 / 3 on each of its 3 tokens: 0.9654894 / 6 = 0.1609149.
    logp, inference_logp, adv, mask, rollout_index = two_rollouts_in_one_row()
    config = LossConfig(
        variant="ppo", ratio_level="sequence", clip_low=0.1, clip_high=0.1, aggregation="sequence_mean"
    )
    loss, metrics = policy_loss(
        logp, inference_logp, adv, mask, 5, config, rollout_index=rollout_index, num_rollouts=2
    )
    assert loss.item() == pytest.approx(-0.0672553, abs=1e-7)
    assert metrics["masked_fraction"].item() == pytest.approx(2 / 5)  # rollout 0's tokens, clipped
    assert metrics["importance_ratio"].item() == pytest.approx((1.2 + 1.2 + 1 + 0.9 + 1) / 5)  # token ratios
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0, 0, 0, 0, 0.1609149, 0.1609149, 0.1609149], abs=1e-7)


def test_aggregations_hand_computed():
    # reinforce, -adv * logp: rollout 0 one token (logp -1, adv 3) -> 3; rollout 1 three (logp -1, -2, -3,
    # adv -1) -> -1, -2, -3. Sum -3.
    logp = torch.tensor(
        [[0.0, -1.0, 0.0, 0.0], [0.0, -1.0, -2.0, -3.0]], dtype=torch.float64, requires_grad=True
    )
    adv = torch.tensor([[3.0] * 4, [-1.0] * 4], dtype=torch.float64)
    mask = torch.tensor([[False, True, False, False], [False, True, True, True]])
    index = torch.tensor([[0, 0, -1, -1], [1, 1, 1, 1]])  # rollout 0, then padding; rollout 1
    counts = {"num_rollouts": 2, "num_budget_tokens": 8}
    expected = {
        # -3 / 4 loss tokens; d/dlogp = -adv / 4.
        "token_mean": (-0.75, [-0.75, 0.25, 0.25, 0.25]),
        # (3 / 1 + -6 / 3) / 2 rollouts = 0.5: the one-token rollout weighs as much as the other; d/dlogp =
        # -adv / (its tokens x 2).
        "sequence_mean": (0.5, [-1.5, 1 / 6, 1 / 6, 1 / 6]),
        # -3 / (examples x rollouts x max_tokens = 8); d/dlogp = -adv / 8.
        "constant": (-0.375, [-0.375, 0.125, 0.125, 0.125]),
    }
    for aggregation, (value, grads) in expected.items():
        config = LossConfig(variant="reinforce", aggregation=aggregation)
        loss, _ = policy_loss(logp, logp.detach(), adv, mask, 4, config, rollout_index=index, **counts)
        (grad,) = torch.autograd.grad(loss, logp)
        assert loss.item() == pytest.approx(value), aggregation
        assert grad[mask].tolist() == pytest.approx(grads), aggregation


def test_token_mismatch_correction_hand_computed():
    # Inference p 0.25; trainer p 0.25, 0.75, 0.5: weights w = 1, 3, 2; cap 2, so only the second is over it.
    logp = probs(0.25, 0.75, 0.5).requires_grad_()
    inference_logp, mask = probs(0.25, 0.25, 0.25), torch.ones(1, 3, dtype=torch.bool)
    cases = {
        # reinforce, adv +1: -ln p = 1.3862944, 0.2876821, 0.6931472, weighted by min(w, 2) = 1, 2, 2:
        # 3.3479515 / 3; by w, 0 above the cap = 1, 0, 2: 2.7725887 / 3. d/dlogp = -weight / 3.
        ("reinforce", "truncate", 1.0): (1.1159843, [-1 / 3, -2 / 3, -2 / 3]),
        ("reinforce", "mask", 1.0): (0.9241962, [-1 / 3, 0, -2 / 3]),
        # ppo, adv -1: -min(-r, -clip(r)) = r = 1, 3, 2 with gradient r; the token over the cap is scaled
        # by 2 / 3 (truncate: 1 + 2 + 2) or dropped (mask: 1 + 0 + 2).
        ("ppo", "truncate", -1.0): (5 / 3, [1 / 3, 2 / 3, 2 / 3]),
        ("ppo", "mask", -1.0): (1.0, [1 / 3, 0, 2 / 3]),
    }
    for (variant, correction, sign), (value, grads) in cases.items():
        config = LossConfig(variant=variant, mismatch_correction=correction, mismatch_cap=2.0)
        adv = torch.full((1, 3), sign, dtype=torch.float64)
        loss, metrics = policy_loss(logp, inference_logp, adv, mask, 3, config)
        (grad,) = torch.autograd.grad(loss, logp)
        assert loss.item() == pytest.approx(value, abs=1e-7), (variant, correction)
        assert grad[0].tolist() == pytest.approx(grads), (variant, correction)
        name = "mismatch_truncated" if correction == "truncate" else "mismatch_masked"
        assert metrics[name].item() == pytest.approx(1 / 3)


def test_sequence_mismatch_correction_hand_computed():
    # Inference p 0.2. Rollout 0 (adv +1): trainer p 0.3, 0.3 -> w 1.5 each, its product 2.25 > cap 2.
    # Rollout 1 (adv -1): p 0.6, 0.1 -> w 3 and 0.5: a token over the cap, but a product of 1.5 under it.
    logp = torch.tensor([[math.log(0.3), math.log(0.3), math.log(0.6), math.log(0.1)]]).double()
    logp.requires_grad_()
    inference_logp = torch.full((1, 4), math.log(0.2), dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]]).double()
    mask, index = torch.ones(1, 4, dtype=torch.bool), torch.tensor([[0, 0, 1, 1]])
    # reinforce, -adv * logp: 1.2039728 twice, then ln 0.6 = -0.5108256 and ln 0.1 = -2.3025851.
    cases = {
        # mask: rollout 0 dropped, rollout 1 weighted by its 1.5: 1.5 * -2.8134107 / 4 = -1.0550290.
        "mask": (-1.0550290, [0.0, 0.0, 1.5 / 4, 1.5 / 4]),
        # truncate: rollout 0 weighted by min(2.25, 2) = 2: (2 * 2.4079456 + 1.5 * -2.8134107) / 4 = 0.1489438.
        "truncate": (0.1489438, [-2 / 4, -2 / 4, 1.5 / 4, 1.5 / 4]),
    }
    for correction, (value, grads) in cases.items():
        config = LossConfig(
            variant="reinforce", mismatch_correction=correction, mismatch_level="sequence", mismatch_cap=2.0
        )
        loss, metrics = policy_loss(logp, inference_logp, adv, mask, 4, config, rollout_index=index)
        (grad,) = torch.autograd.grad(loss, logp)
        assert loss.item() == pytest.approx(value, abs=1e-7), correction
        assert grad[0].tolist() == pytest.approx(grads), correction
        name = "mismatch_truncated" if correction == "truncate" else "mismatch_masked"
        assert metrics[name].item() == pytest.approx(2 / 4)  # rollout 0's tokens, not rollout 1's w = 3 token


def test_cispo_truncated_weight_is_its_clipped_weight_of_the_capped_ratio():
    # w = 1, 4, 10 (inference p 0.05), cap 3, clip_high 0.28: CISPO's own weight min(w, 1.28) with w replaced
    # by min(w, 3) is 1, 1.28, 1.28; never below the clip because w went further past the cap.
    logp = probs(0.05, 0.2, 0.5).requires_grad_()
    config = LossConfig(variant="cispo", mismatch_correction="truncate", mismatch_cap=3.0)
    loss, _ = policy_loss(
        logp, probs(0.05, 0.05, 0.05), torch.ones(1, 3), torch.ones(1, 3, dtype=torch.bool), 3, config
    )
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0].tolist() == pytest.approx([-1 / 3, -1.28 / 3, -1.28 / 3])


# Three rollouts in one packed row, a prompt token before each: (advantage, [(p_train, p_inference), ...]).
# Token ratios 0.9, 1.5, 3.5 | 0.5, 2.5 | 1.2, 0.75, 2.5; rollout products 4.725, 1.25, 2.25.
MISMATCH_ROLLOUTS = [
    (1.0, [(0.45, 0.5), (0.3, 0.2), (0.35, 0.1)]),
    (-1.0, [(0.3, 0.6), (0.75, 0.3)]),
    (0.5, [(0.3, 0.25), (0.3, 0.4), (0.25, 0.1)]),
]
LEVELS = ("token", "sequence")


def mismatch_expected(config: LossConfig):
    """The loss, d loss / d logp of each loss token, and the metrics of MISMATCH_ROLLOUTS, token by token from
    the formulas as the docs write them (token_mean over the step's 8 loss tokens)."""
    tokens = [(i, adv, p, q) for i, (adv, pairs) in enumerate(MISMATCH_ROLLOUTS) for p, q in pairs]
    lengths = [len(pairs) for _, pairs in MISMATCH_ROLLOUTS]
    rollout_w = [math.prod(p / q for p, q in pairs) for _, pairs in MISMATCH_ROLLOUTS]
    truncating = config.mismatch_correction == "truncate" and config.variant != "reinforce"
    cap, high, low = config.mismatch_cap, 1 + config.clip_high, 1 - config.clip_low
    loss, grads, masked, over = 0.0, [0.0] * len(tokens), 0, 0
    for t, (i, adv, p, q) in enumerate(tokens):
        r = p / q
        w = r if config.mismatch_level == "token" else rollout_w[i]
        over_cap = config.mismatch_correction != "none" and w > cap
        over += over_cap
        # The variant's ratio, with w replaced by min(w, cap) when truncating, and which tokens' logp it moves with.
        if config.ratio_level == "token":
            ratio = min(r, cap) if truncating else r
            moves = {t: ratio}
        else:
            ratio = (min(rollout_w[i], cap) if truncating else rollout_w[i]) ** (1 / lengths[i])
            moves = {u: ratio / lengths[i] for u, token in enumerate(tokens) if token[0] == i}
        if config.variant == "dppo":
            moved = p - q  # dppo's trust region: how far the probability moved, toward adv or not
            delta = config.mask_threshold
            kept = not ((adv > 0 and moved > delta) or (adv < 0 and moved < -delta))
            value = -(ratio * adv if kept else 0.0) + config.log_ratio_coef * math.log(r) ** 2
            token_grads = {t: -(ratio * adv if kept else 0.0) + 2 * config.log_ratio_coef * math.log(r)}
            masked += not kept
        elif config.variant == "ppo":
            clipped = min(max(ratio, low), high)
            value = -min(ratio * adv, clipped * adv)
            active = not ((adv > 0 and ratio > high) or (adv < 0 and ratio < low))
            token_grads = {u: -adv * d if active else 0.0 for u, d in moves.items()}
            masked += not active
        elif config.variant == "cispo":
            value = -min(ratio, high) * adv * math.log(p)
            token_grads = {t: -min(ratio, high) * adv}
            masked += ratio > high
        else:
            factors = {"none": 1.0, "truncate": min(w, cap), "mask": 0.0 if over_cap else w}
            factor = factors[config.mismatch_correction]
            value = -adv * math.log(p) * factor
            token_grads = {t: -adv * factor}
        if config.mismatch_correction == "mask" and config.variant != "reinforce" and over_cap:
            value, token_grads = 0.0, {}
        loss += value / len(tokens)
        for u, g in token_grads.items():
            grads[u] += g / len(tokens)
    return loss, grads, masked / len(tokens), over / len(tokens)


def test_every_mismatch_correction_against_its_formula():
    """Each variant x correction x ratio level x mismatch level, at a cap above and below ppo/cispo's upper clip:
    policy_loss against mismatch_expected, or a one-sentence refusal where the levels cannot combine."""
    row, index = [], []
    for i, (_, pairs) in enumerate(MISMATCH_ROLLOUTS):
        row += [(1.0, 1.0)] + pairs  # a prompt token, off the loss, with inference logp 0 as rl.py packs it
        index += [i] * (len(pairs) + 1)
    logp = torch.tensor([[math.log(p) for p, _ in row]], dtype=torch.float64, requires_grad=True)
    inference_logp = torch.tensor([[math.log(q) for _, q in row]], dtype=torch.float64)
    mask = torch.tensor([[n not in (0, 4, 7) for n in range(len(row))]])
    adv = torch.tensor([[MISMATCH_ROLLOUTS[i][0] for i in index]], dtype=torch.float64)
    combinations = itertools.product(
        (2.0, 1.1), ("dppo", "ppo", "cispo", "reinforce"), ("none", "truncate", "mask"), LEVELS, LEVELS
    )
    checked = 0
    for cap, variant, correction, ratio_level, mismatch_level in combinations:
        options = dict(
            variant=variant, mismatch_correction=correction, ratio_level=ratio_level,
            mismatch_level=mismatch_level, mismatch_cap=cap,
        )  # fmt: skip
        if ratio_level == "sequence" and variant in ("dppo", "reinforce"):
            with pytest.raises(UserError, match="ratio_level sequence applies to"):
                LossConfig(**options)
        elif correction == "truncate" and variant != "reinforce" and ratio_level != mismatch_level:
            with pytest.raises(UserError, match="must equal loss.ratio_level"):
                LossConfig(**options)
        else:
            config = LossConfig(**options)
            loss, metrics = policy_loss(
                logp, inference_logp, adv, mask, 8, config, rollout_index=torch.tensor([index])
            )
            (grad,) = torch.autograd.grad(loss, logp)
            value, grads, masked, over = mismatch_expected(config)
            assert loss.item() == pytest.approx(value, abs=1e-12), options
            assert grad[mask].tolist() == pytest.approx(grads, abs=1e-12), options
            assert grad[~mask].abs().max().item() == 0, options
            assert metrics["masked_fraction"].item() == pytest.approx(masked), options
            if correction != "none":
                name = "mismatch_truncated" if correction == "truncate" else "mismatch_masked"
                assert metrics[name].item() == pytest.approx(over), options
            checked += 1
    assert checked == 2 * (5 + 6 + 10 + 10)  # per cap: dppo, reinforce, ppo, cispo


SEQUENCE_LEVEL = {
    "gspo": LossConfig(variant="ppo", ratio_level="sequence", aggregation="sequence_mean", clip_high=0.1),
    "cispo_sequence_masked": LossConfig(
        variant="cispo", ratio_level="sequence", mismatch_correction="mask", mismatch_level="sequence",
        mismatch_cap=1.3,
    ),
    "gspo_sequence_truncated": LossConfig(
        variant="ppo", ratio_level="sequence", mismatch_correction="truncate", mismatch_level="sequence",
        mismatch_cap=1.3,
    ),
    "dppo_constant": LossConfig(aggregation="constant"),
}  # fmt: skip


@pytest.mark.parametrize("config", SEQUENCE_LEVEL.values(), ids=SEQUENCE_LEVEL.keys())
def test_sequence_level_quantities_do_not_depend_on_packing(config):
    """The same rollouts one to a row, many to a row, and one row per micro-batch over several micro-batches:
    the step's loss, each token's gradient and the metrics agree."""
    from lib.orchestrator.rollouts import Rollout
    from lib.trainer.packing import rl_micro_batches

    rng = random.Random(0)
    rollouts = []
    for i in range(7):
        length = rng.randint(3, 9)
        rollouts.append(
            Rollout(
                token_ids=[100 * (i + 1) + j for j in range(length)],  # every token id its own
                loss_mask=[False] + [rng.random() < 0.8 for _ in range(length - 1)],
                inference_logp=[0.0] + [-1.5 + rng.uniform(-0.5, 0.5) for _ in range(length - 1)],
                reward=0.0,
                policy_version=0,
                advantage=rng.choice([-1.0, 0.5, 1.0]),
            )
        )
    # The trainer's logp of each token: a leaf of its own, so gradients compare token by token.
    logp_of = {
        t: torch.tensor(-1.5 + rng.uniform(-0.6, 0.6), requires_grad=True)
        for r in rollouts
        for t in r.token_ids
    }
    counts = {
        "num_loss_tokens": sum(sum(r.loss_mask) for r in rollouts),
        "num_rollouts": len(rollouts),
        "num_episodes": len(rollouts),
        "num_budget_tokens": 64,
    }

    def step(packing: bool, seq_len: int, rows_per_micro_batch: int):
        for leaf in logp_of.values():
            leaf.grad = None
        micro_batches = rl_micro_batches(rollouts, seq_len, rows_per_micro_batch, packing=packing)
        total, metrics = 0.0, {}
        for mb in micro_batches:
            logp = torch.stack([logp_of.get(int(t), torch.tensor(0.0)) for t in mb.input_ids.flatten()])
            loss, values = policy_loss(
                logp.view(mb.input_ids.shape), mb.inference_logp, mb.advantages, mb.loss_mask,
                config=config, rollout_index=mb.rollout_index, **counts,
            )  # fmt: skip
            loss.backward()
            total += loss.item()
            metrics = {name: metrics.get(name, 0.0) + value.item() for name, value in values.items()}
        grads = {t: 0.0 if leaf.grad is None else leaf.grad.item() for t, leaf in logp_of.items()}
        return [len(mb.input_ids) for mb in micro_batches], total, grads, metrics

    layouts = [step(False, 16, 100), step(True, 24, 100), step(True, 16, 1)]
    assert layouts[0][0] == [7]  # one micro-batch, a rollout to a row
    assert len(layouts[1][0]) == 1 and layouts[1][0][0] < 7  # one micro-batch, rollouts sharing rows
    assert len(layouts[2][0]) > 2  # a row per micro-batch, several micro-batches
    _, total, grads, metrics = layouts[0]
    assert total != 0.0 and any(grads.values())
    corrected = [
        value for name, value in metrics.items() if name.startswith("mismatch_") and name != "mismatch_kl"
    ]
    assert all(0 < value < 1 for value in corrected)  # some rollouts over the cap, not all
    for _, other_total, other_grads, other_metrics in layouts[1:]:
        assert other_total == pytest.approx(total, abs=1e-6)
        assert other_grads == pytest.approx(grads, abs=1e-6)
        assert other_metrics == pytest.approx(metrics, abs=1e-6)


def test_rl_imports_a_custom_loss_from_its_working_directory_and_refuses_a_bad_one_before_any_model(tmp_path):
    """scripts/rl.py as users run it, from a directory that holds the loss's module and nothing else puts on
    the path (tests/conftest.py's sys.path reaches no subprocess)."""
    (tmp_path / "my_loss.py").write_text(
        "from pathlib import Path\n"
        "Path('imported_from').write_text(__file__)\n"
        "def loss(logp, *args, **kwargs):\n"
        "    return logp.sum(), {}\n"
    )
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}

    def rl(import_path: str, *flags: str) -> subprocess.CompletedProcess:
        command = [sys.executable, str(ROOT / "scripts" / "rl.py"), "--loss.import-path", import_path, *flags]
        return subprocess.run(
            command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=120
        )

    # A later mistake of the config stops the run at parse time, after the loss's module was imported.
    found = rl("my_loss:loss", "--rollouts-per-example", "1")
    assert found.returncode == 2 and "rollouts_per_example must be at least 2" in found.stderr, found.stderr
    assert (tmp_path / "imported_from").read_text() == str(tmp_path / "my_loss.py")
    # A bad path is one sentence, before main() would load the model (which does not exist here).
    failed = rl("no_such_module:loss", "--model.name", str(tmp_path / "no_such_model"))
    not_found = f"error: loss.import_path: cannot import no_such_module from the Python path or {tmp_path} ("
    assert failed.returncode == 2 and failed.stderr.startswith(not_found), failed.stderr
    assert failed.stderr.count("\n") == 1, failed.stderr


def test_new_options_reject_bad_values_and_a_custom_loss_is_found_by_its_path(monkeypatch, tmp_path):
    from lib.trainer.loss import loss_function

    with pytest.raises(ValueError, match="ratio_level sequence applies to"):
        LossConfig(variant="dppo", ratio_level="sequence")
    with pytest.raises(ValueError, match="mismatch_cap must be >= 1"):
        LossConfig(mismatch_cap=0.5)
    with pytest.raises(ValueError, match="package.module:function"):
        LossConfig(import_path="no_colon_here")
    assert loss_function(LossConfig()) is policy_loss
    (tmp_path / "my_losses.py").write_text(
        "def half(logp, *args, **kwargs):\n    return logp.sum() / 2, {}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    custom = loss_function(LossConfig(import_path="my_losses:half"))
    assert custom(torch.ones(1, 4))[0].item() == 2.0
    with pytest.raises(ValueError, match="has no function missing"):
        loss_function(LossConfig(import_path="my_losses:missing"))
    with pytest.raises(ValueError, match="cannot import no_such_module"):
        loss_function(LossConfig(import_path="no_such_module:half"))


def test_reference_kl_k1_and_k3_hand_computed():
    # Trainer p = 0.5, 0.8, 0.2 on the loss tokens, the reference 0.5, 0.4, 0.4: log r = 0, ln 2, -ln 2.
    #   k1 = log r                   -> 0, 0.6931472, -0.6931472: mean 0
    #   k3 = exp(-log r) - 1 + log r -> 0, 0.1931472, 0.3068528:  mean 0.5 / 3 = 0.1666667
    # The fourth token is off the loss mask: no KL there, whatever the reference says.
    # adv 0: reinforce's own term is 0, so the loss is kl_coef x the mean KL over the 3 loss tokens.
    logp_values = probs(0.5, 0.8, 0.2, 0.9)
    ref_logp = probs(0.5, 0.4, 0.4, 0.1)
    mask = torch.tensor([[True, True, True, False]])
    for estimator, mean_kl, dkl in [("k1", 0.0, [1, 1, 1, 0]), ("k3", 0.5 / 3, [0, 0.5, -1, 0])]:
        logp = logp_values.clone().requires_grad_()
        config = LossConfig(variant="reinforce", kl_coef=0.1, kl_estimator=estimator)
        loss, metrics = policy_loss(
            logp, logp_values, torch.zeros(1, 4, dtype=torch.float64), mask, 3, config, ref_logp=ref_logp
        )
        assert loss.item() == pytest.approx(0.1 * mean_kl, abs=1e-9), estimator
        assert metrics["ref_kl"].item() == pytest.approx(mean_kl, abs=1e-9), estimator
        loss.backward()
        # d k1 / d logp = 1; d k3 / d logp = 1 - exp(-log r) = 1 - ref / p: 0, 1 - 0.5, 1 - 2.
        assert logp.grad[0].tolist() == pytest.approx([0.1 * g / 3 for g in dkl], abs=1e-9), estimator


def test_the_kl_and_the_entropy_bonus_add_to_the_policy_loss_per_token_before_the_aggregation():
    # dppo on two rollouts of 1 and 2 tokens (the hand-computed -0.1197371 case's t0-t2), sequence_mean:
    # per-token dppo: -1.0, 0 + 1e-3 ln(1.6)^2, -1.2 + 1e-3 ln(1.2)^2. Reference = inference (p 0.5):
    # k3 = 0, 0.5/0.8 - 1 + ln 1.6, 0.5/0.6 - 1 + ln 1.2; entropies 1, 2, 3 (bonus -0.01 each).
    logp = probs(0.5, 0.8, 0.6).requires_grad_()
    token_entropy = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64, requires_grad=True)
    inference_logp = probs(0.5, 0.5, 0.5)
    config = LossConfig(aggregation="sequence_mean", kl_coef=0.05, entropy_coef=0.01)
    loss, metrics = policy_loss(
        logp, inference_logp, torch.ones(1, 3, dtype=torch.float64), torch.ones(1, 3, dtype=torch.bool), 3,
        config, rollout_index=torch.tensor([[0, 1, 1]]), num_rollouts=2, ref_logp=inference_logp,
        token_entropy=token_entropy,
    )  # fmt: skip
    k3 = [0.0, 0.625 - 1 + math.log(1.6), 0.5 / 0.6 - 1 + math.log(1.2)]
    dppo = [-1.0, 1e-3 * math.log(1.6) ** 2, -1.2 + 1e-3 * math.log(1.2) ** 2]
    per_token = [d + 0.05 * k - 0.01 * e for d, k, e in zip(dppo, k3, [1, 2, 3])]
    assert loss.item() == pytest.approx((per_token[0] + (per_token[1] + per_token[2]) / 2) / 2, abs=1e-9)
    assert metrics["ref_kl"].item() == pytest.approx(sum(k3) / 3, abs=1e-9)  # a token mean, as every metric
    loss.backward()
    # Each token's weight: 1/2 (rollout 0 alone) or 1/4 (half of rollout 1); the bonus's gradient is -0.01.
    assert token_entropy.grad[0].tolist() == pytest.approx([-0.01 / 2, -0.01 / 4, -0.01 / 4], abs=1e-12)
    dk3 = [1 - 0.5 / p for p in (0.5, 0.8, 0.6)]
    ddppo = [-1.0, 2e-3 * math.log(1.6), -1.2 + 2e-3 * math.log(1.2)]
    expected = [(d + 0.05 * k) * w for d, k, w in zip(ddppo, dk3, [1 / 2, 1 / 4, 1 / 4])]
    assert logp.grad[0].tolist() == pytest.approx(expected, abs=1e-9)


def test_kl_and_entropy_are_off_by_default_and_refuse_negative_weights():
    logp, mask = probs(0.5, 0.8), torch.ones(1, 2, dtype=torch.bool)
    plain, _ = policy_loss(logp, probs(0.5, 0.5), torch.ones(1, 2), mask, 2, LossConfig())
    with_inputs, metrics = policy_loss(
        logp, probs(0.5, 0.5), torch.ones(1, 2), mask, 2, LossConfig(),
        ref_logp=probs(0.1, 0.1), token_entropy=torch.ones(1, 2),
    )  # fmt: skip
    assert with_inputs.item() == plain.item() and metrics["ref_kl"].item() > 0  # logged, not trained on
    for field in ("kl_coef", "entropy_coef"):
        with pytest.raises(UserError, match="must be >= 0"):
            LossConfig(**{field: -0.1})
