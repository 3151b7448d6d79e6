"""AdamW as build_optimizer makes it: fused on CPU, the same steps as torch's default implementation."""

import torch

from lib.optim import OptimConfig, build_optimizer


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
