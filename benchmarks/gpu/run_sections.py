"""The GPU check's sections that run scripts/sft.py's and scripts/rl.py's main() (benchmarks/gpu/gpu_check.py runs
them): median tokens/s, MFU and memory of an SFT run; an RL run's rates, syncs, weight checks and probes.

Standard library only at the top: gpu_check.py imports it before the carried wheels are installed.
"""

import statistics
import threading

from benchmarks.common import ROOT, load_script
from benchmarks.gpu.trainer_sections import GIB, Setup, flops_per_token, mfu, peak_gib, reset_peak


def section_sft(setup: Setup) -> dict:

    from lib.config import parse
    from lib.models.load import load_tokenizer
    from lib.orchestrator.data import load_conversations, tokenize_all

    sft = load_script("sft")
    plan = setup.plan["sft"]
    args = ["@", str(ROOT / "configs/reverse_text/sft.toml"), "--model.name", str(setup.model_dir)]
    args += ["--model.device", setup.device, "--output-dir", str(setup.work / "sft"), "--log-every", "5"]
    args += ["--data.id", "reverse_text", "--data.num-examples", str(plan["steps"] * plan["batch-size"])]
    args += [token for name, value in plan.items() for token in (f"--{name}", str(value))]
    cfg = parse(sft.Config, args)
    reset_peak(setup)
    history = sft.main(cfg)["history"]
    peak = peak_gib(setup)
    speed = statistics.median(m["perf/tokens_per_second"] for m in history[1:] or history)
    utilisation = None
    if setup.cuda:  # the attention term needs the samples' lengths: tokenized again, as sft.py did
        samples, _ = tokenize_all(load_tokenizer(cfg.model.name), load_conversations(cfg.data), cfg.seq_len)
        lengths = [len(ids) for ids, _ in samples]
        attended = sum(n * n for n in lengths) / sum(lengths)  # the per-token mean of each sample's length
        utilisation = mfu(setup, speed * flops_per_token(setup, attended))
    return {
        "steps": len(history),
        "tokens_per_second": speed,
        "mfu": utilisation,
        "peak_memory_gib": peak,
        "final_loss": history[-1]["train/loss"],
    }


def section_rl(setup: Setup) -> dict:
    import torch

    from lib.config import parse
    from lib.inference.weights import probing
    from lib.trainer import packing

    rl = load_script("rl")
    args = ["@", str(ROOT / "configs/reverse_text/rl.toml"), "--model.name", str(setup.model_dir)]
    args += ["--model.device", setup.device, "--output-dir", str(setup.work / "rl")]
    args += ["--env.id", str(ROOT / "benchmarks" / "letters.py")]  # a reward that varies for random weights
    args += "--steps 3 --max-async-level 0 --inference.engine torch".split()
    args += ["--checkpoint-every", "1000"]
    args += [token for name, value in setup.plan["rl"].items() for token in (f"--{name}", str(value))]
    cfg = parse(rl.Config, args)

    # rl.py's own functions, wrapped: what each step sampled, and what every weight check found.
    sampled_tokens, checks = [], []
    micro_batches, compare = packing.rl_micro_batches, probing.compare

    def counting(rollouts, *args, **kwargs):
        sampled_tokens.append(sum(sum(r.loss_mask) for r in rollouts))
        return micro_batches(rollouts, *args, **kwargs)

    def checking(probe, trainer_logprobs, label, tolerance, when):
        difference = compare(probe, trainer_logprobs, label, tolerance, when)
        checks.append((probe.label == label, difference, tolerance))
        return difference

    device_peak, stop = [0], threading.Event()

    def sample_device_memory():
        while not stop.wait(0.2):
            free, total = torch.cuda.mem_get_info()
            device_peak[0] = max(device_peak[0], total - free)

    if setup.cuda:
        threading.Thread(target=sample_device_memory, daemon=True).start()
    packing.rl_micro_batches, probing.compare = counting, checking
    reset_peak(setup)
    try:
        history = rl.main(cfg)["history"]
    finally:
        packing.rl_micro_batches, probing.compare = micro_batches, compare
        stop.set()
    waited = sum(m["time/wait_rollouts"] for m in history)
    return {
        "steps": len(history),
        "rollout_tokens_per_second": sum(sampled_tokens) / waited,
        "train_tokens_per_second": statistics.median(m["perf/tokens_per_second"] for m in history),
        "sync_seconds": [m["time/sync_weights"] for m in history],
        "weight_checks": f"{sum(reported for reported, _, _ in checks)}/{len(checks)} reported the new weights",
        "probe_differences": [difference for _, difference, _ in checks],
        "probe_tolerance": checks[0][2],
        "reward_mean": [m["reward/mean"] for m in history],
        "trainer_peak_memory_gib": peak_gib(setup),
        "device_peak_memory_gib": device_peak[0] / GIB if setup.cuda else None,
    }
