"""A LoRA run's weight sync, adapter against merged: bytes written and seconds per sync at a real Qwen3 shape,
and the step time of the tiny LoRA preset both ways.

Part 1 (`--shape`, default 1.7B, the largest Qwen3 shape whose merged sync fits in 24 GB beside a server:
4B's float32 trainer alone is 16 GB). Random weights, Qwen's tokenizer, a server in bfloat16 started with
--max-lora-rank (vLLM's CPU build by default), and the trainer's LoRA model (float32, r 32 on every linear
layer) in this process. `--syncs` adapter syncs, then as many merged ones. Before each one the adapter's B
moves (as a step would move it); then rl.py's own calls run: weights.save_weights (the adapter alone,
or the merged model), reload.reload_weights (pause, load, label, cache reset, resume) and the probe, the
server's logprobs against the trainer's. No training runs: at this shape it would not fit beside the server.

Part 2: configs/tiny/rl.toml with --lora.rank 8 on the tiny model (the tests' SFT-warmed one when
outputs/test-cache has it, else an untrained one, whose groups are all flat), rl.py starting its own builtin server,
the same steps with --inference.lora-sync adapter and merged; the mean step and sync seconds after step 1.

Usage:
    python benchmarks/inference/bench_lora_sync.py                              # 1.7B on vLLM's CPU build, 3 syncs each
    python benchmarks/inference/bench_lora_sync.py --shape test --engine torch   # a quick check
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/
from benchmarks.common import ROOT  # noqa: E402


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def real_shape(args, root: Path) -> None:
    import torch

    from lib.inference import launch
    from lib.inference.weights import probing, reload
    from lib.models.load import ModelConfig, load_tokenizer
    from lib.models.qwen import QwenConfig, write_qwen
    from lib.trainer.servable import save_weights
    from lib.trainer.trainable import LoraConfig, load_trainable

    began = time.perf_counter()
    base = write_qwen(root / "base", QwenConfig(shape=args.shape))
    print(f"Qwen3-{args.shape} shape written in {time.perf_counter() - began:.0f} s", flush=True)
    extra = ["--model.dtype", "bfloat16", "--max-lora-rank", str(args.rank), "--max-model-len", "512"]
    extra += ["--vllm.cpu-kv-cache-gib", "1"]
    began = time.perf_counter()
    with launch.running_server(
        str(base), engine=args.engine, weights_root=root, log_path=root / "serve.log", extra_args=extra
    ) as server:
        print(f"{args.engine} server up in {time.perf_counter() - began:.0f} s", flush=True)
        lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
        model, _, autocast = load_trainable(ModelConfig(name=str(base)), lora, "cpu", 1, packing=False)
        tokenizer = load_tokenizer(str(base))
        prompt = tokenizer.encode(probing.PROBE_TEXT, add_special_tokens=False)
        rows = {"adapter": [], "merged": []}
        print(
            f"{'sync':>8} {'MB written':>10} {'write s':>8} {'load s':>7} {'probe s':>8} {'probe diff':>10}"
        )
        # Adapters first: a merged load replaces the server's base weights, which the adapter adds to.
        for index in range(2 * args.syncs):
            mode = "adapter" if index < args.syncs else "merged"
            with torch.no_grad():  # a step's worth of change in the adapter
                for name, param in model.named_parameters():
                    if "lora_B" in name:
                        param.add_(torch.randn_like(param) * 1e-3)
            began = time.perf_counter()
            path = save_weights(
                root / "run", index + 1, model, tokenizer, torch.bfloat16, 2, mode == "adapter"
            )
            written = time.perf_counter()
            adapter = launch.ADAPTER_NAME if mode == "adapter" else None
            reload.reload_weights([server.url], path, None, f"step_{index + 1}", "wait", adapter)
            loaded = time.perf_counter()
            name = launch.ADAPTER_NAME if adapter else str(base)
            probe = probing.probe(server.url, name, prompt, None)
            trainer = probing.trainer_logprobs(model, autocast, prompt, probe.completion_ids)
            difference = probing.compare(
                probe, trainer, f"step_{index + 1}", probing.BF16_PROBE_TOLERANCE, "now"
            )
            probed = time.perf_counter()
            row = (directory_bytes(path), written - began, loaded - written, probed - loaded, difference)
            rows[mode].append(row)
            print(
                f"{mode:>8} {row[0] / 1e6:10.1f} {row[1]:8.2f} {row[2]:7.2f} {row[3]:8.2f} {row[4]:10.4f}",
                flush=True,
            )
    means = {mode: [statistics.mean(column) for column in zip(*r)] for mode, r in rows.items()}
    adapter, merged = means["adapter"], means["merged"]
    for mode, m in means.items():
        total = sum(m[1:4])
        print(
            f"mean {mode}: {m[0] / 1e6:.1f} MB, write {m[1]:.2f} s + load {m[2]:.2f} s + probe {m[3]:.2f} s = {total:.2f} s"
        )
    print(
        f"adapter / merged: bytes {adapter[0] / merged[0]:.4f}, seconds {sum(adapter[1:4]) / sum(merged[1:4]):.3f} "
        f"(write {adapter[1] / merged[1]:.3f}, load {adapter[2] / merged[2]:.3f})"
    )


def tiny_preset(args, root: Path) -> None:
    from benchmarks.common import load_script
    from lib.config import parse
    from lib.models.tiny import write_tiny

    rl = load_script("rl")
    # The tests' SFT-warmed tiny model when there is one (groups with a spread of rewards, so steps train).
    warmed = sorted(ROOT.glob("outputs/test-cache/trained-tiny-*/weights/step_300"))
    model = warmed[-1] if warmed else write_tiny(root / "tiny")
    print(f"tiny model: {model}", flush=True)
    for mode in ("adapter", "merged"):
        flags = ["@", str(ROOT / "configs/tiny/rl.toml"), "--model.name", str(model), "--lora.rank", "8"]
        flags += ["--output-dir", str(root / f"tiny-{mode}"), "--steps", str(args.tiny_steps)]
        flags += ["--inference.lora-sync", mode, "--inference.engine", "torch", "--checkpoint-every", "1000"]
        history = rl.main(parse(rl.Config, flags))["history"][1:]
        step = statistics.mean(m["time/step"] for m in history)
        synced = statistics.mean(m["time/sync_weights"] for m in history)
        print(f"tiny LoRA preset, {mode} sync: {step:.3f} s/step, of which sync {synced:.3f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="1.7B", choices=["test", "0.6B", "1.7B", "4B"])
    parser.add_argument("--engine", default="vllm", choices=["vllm", "torch"])
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--syncs", type=int, default=3, help="syncs of each kind")
    parser.add_argument("--tiny-steps", type=int, default=11)
    parser.add_argument("--skip-real-shape", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=ROOT / "outputs") as tmp:
        if not args.skip_real_shape:
            real_shape(args, Path(tmp))
        tiny_preset(args, Path(tmp))


if __name__ == "__main__":
    main()
