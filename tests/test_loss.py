"""Policy loss: each variant on hand-computed values, gradient direction, step-wide normalisation, masking."""

import math

import pytest
import torch

from lib.loss import LossConfig, entropy, policy_loss, token_logp


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
