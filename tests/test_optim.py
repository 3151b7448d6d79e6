"""AdamW as build_optimizer makes it: fused on CPU, the same steps as torch's default implementation."""

import torch

from lib.trainer.optim import OptimConfig, build_optimizer


def test_adamw_on_cpu_is_fused_and_takes_the_default_implementations_steps():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    optimizer, _ = build_optimizer(params, OptimConfig(lr=1e-2, weight_decay=0.1), total_steps=3)
    plain = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, foreach=False)
    assert optimizer.defaults["fused"]
    for _ in range(3):
        for param, twin in zip(params, reference):
            param.grad = torch.randn_like(param)
            twin.grad = param.grad.clone()
        optimizer.step()
        plain.step()
    for param, twin in zip(params, reference):
        torch.testing.assert_close(param, twin)
    assert all(state["exp_avg"].dtype == torch.float32 for state in optimizer.state.values())


def test_a_warmup_as_long_as_the_run_is_cut_to_a_tenth_and_said(capsys):
    params = [torch.nn.Parameter(torch.randn(4))]
    config = OptimConfig(lr=8e-3, schedule="cosine", warmup_steps=50)
    optimizer, scheduler = build_optimizer(params, config, total_steps=40)
    rates = []
    for _ in range(40):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert rates[3] == 8e-3  # the peak after 4 steps of warm-up, not 0.0064 of it after 40
    assert rates[-1] < 1e-4  # and the cosine decays to the end
    out = capsys.readouterr().out
    assert (
        out
        == "optim.warmup_steps 50 is not shorter than the run (40 steps): warming up over 4 steps instead\n"
    )
    _, scheduler = build_optimizer(params, OptimConfig(warmup_steps=5), total_steps=40)
    assert capsys.readouterr().out == ""
