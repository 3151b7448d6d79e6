"""A CPU dress rehearsal of the reverse_text recipe at a real Qwen3 shape: random weights, Qwen's tokenizer,
a bf16 server (the builtin engine and vLLM's CPU build), rl.py for a few steps of a small batch.

Per engine and pause mode, rl.py runs in a child process attached to a server this script starts in
bfloat16 (the trainer keeps float32 weights, so the probe runs at the bf16 tolerance). Per step it prints
the rollout and train seconds, the sync split into the pause (its wait for in-flight completions), the
write of weights/step_N, the servers' load and the probe, the bytes written, the probe's mean |logprob
difference|, and the trainer's and the server's peak RSS during the step (sampled every 0.2 s). The recipe's batch is 8 x 16 rollouts of
up to 128 tokens; the default here is 2 x 4, and the rollout seconds scale about with the tokens generated.

Usage:
    python benchmarks/rl/bench_real_shape.py                          # 0.6B shape, both engines, wait and keep
    python benchmarks/rl/bench_real_shape.py --shape test --steps 2   # the 2-layer shape, a quick check
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/
from benchmarks.common import ROOT  # noqa: E402

GIB = 1024**3


def peak_rss(process_ids, peaks: dict, stop: threading.Event) -> None:
    """Keeps peaks[name] = the largest RSS (bytes) of each process tree seen, every 0.2 s."""
    import psutil

    while not stop.is_set():
        for name, pid in process_ids.items():
            try:
                root = psutil.Process(pid)
                rss = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
            except psutil.Error:
                continue
            peaks[name] = max(peaks.get(name, 0), rss)
        stop.wait(0.2)


def child(args) -> None:
    """rl.py in this process, its sync phases timed; prints one JSON line per step."""
    from benchmarks.common import load_script
    from lib.config import parse
    from lib.inference.weights import probing, reload
    from lib.trainer import servable

    syncs = [{}]  # one dict of phase seconds per weight sync: the run's start, then every step
    peaks, stop = {}, threading.Event()
    threading.Thread(
        target=peak_rss, args=({"trainer": os.getpid(), "server": args.server_pid}, peaks, stop), daemon=True
    ).start()

    def timed(phase, function, after=None):
        def call(*a, **k):
            began = time.perf_counter()
            result = function(*a, **k)
            key = phase(*a) if callable(phase) else phase
            syncs[-1][key] = syncs[-1].get(key, 0.0) + time.perf_counter() - began
            if after:
                after(result)
            return result

        return call

    save_weights = servable.save_weights

    def save_and_start(*a, **k):
        began = time.perf_counter()
        path = save_weights(*a, **k)
        written = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
        # The peaks since the last sync: the step's rollouts and training (the start's: loading the model).
        step_peaks = {f"{name}_peak": peaks.pop(name, 0) for name in ("trainer", "server")}
        syncs.append({"write_s": time.perf_counter() - began, "bytes": written, **step_peaks})
        return path

    servable.save_weights = save_and_start
    phases = {"/pause": "pause_s", "/collective_rpc": "load_s"}
    reload.post = timed(lambda http, url, path, *r: phases.get(path.split("?")[0], "other_s"), reload.post)
    probing.probe = timed("probe_s", probing.probe)
    probing.trainer_logprobs = timed("probe_s", probing.trainer_logprobs)

    rl = load_script("rl")
    rl_args = ["@", str(ROOT / "configs/reverse_text/rl.toml"), "--model.name", args.model]
    rl_args += ["--output-dir", args.out, "--inference.urls", args.url, "--steps", str(args.steps)]
    rl_args += ["--examples-per-step", str(args.examples), "--rollouts-per-example", str(args.rollouts)]
    rl_args += ["--sampling.max-tokens", str(args.max_tokens), "--inference.pause-mode", args.pause_mode]
    rl_args += ["--inference.probe-tolerance", "0.05", "--checkpoint-every", "1000", "--keep-weights", "2"]
    rl_args += ["--seq-len", "1024", "--env.id", args.env]
    history = rl.main(parse(rl.Config, rl_args))["history"]
    stop.set()
    for step, metrics in enumerate(history, start=1):
        phases_of_step = syncs[step + 1] if step + 1 < len(syncs) else {}  # [1] is the run's start
        print(
            "STEP "
            + json.dumps(
                {
                    "step": step,
                    "rollout_s": metrics["time/wait_rollouts"],
                    "train_s": metrics["time/train"],
                    "sync_s": metrics["time/sync_weights"],
                    **phases_of_step,
                    "probe_difference": metrics.get("sync/probe_logprob_difference"),  # on-policy only
                }
            )
        )
    print(
        "PEAKS "
        + json.dumps({name: max(s.get(f"{name}_peak", 0) for s in syncs) for name in ("trainer", "server")})
    )


def rehearse(engine: str, pause_mode: str, model: Path, root: Path, args) -> tuple[list[dict], dict, float]:
    from lib.inference import launch

    extra = ["--model.dtype", "bfloat16", "--max-model-len", "2048", "--vllm.cpu-kv-cache-gib", "2"]
    extra += ["--weights-root", str(root)]
    began = time.perf_counter()
    log = root / f"{engine}-{pause_mode}.log"
    with launch.running_server(str(model), engine=engine, log_path=log, extra_args=extra) as server:
        started = time.perf_counter() - began
        command = [sys.executable, __file__, "--child", "--model", str(model), "--url", server.url]
        command += [
            "--server-pid",
            str(server.process.pid),
            "--out",
            str(root / f"run-{engine}-{pause_mode}"),
        ]
        command += ["--pause-mode", pause_mode, "--steps", str(args.steps), "--examples", str(args.examples)]
        command += ["--rollouts", str(args.rollouts), "--max-tokens", str(args.max_tokens), "--env", args.env]
        done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [json.loads(line[5:]) for line in done.stdout.splitlines() if line.startswith("STEP ")]
    peaks = next(json.loads(line[6:]) for line in done.stdout.splitlines() if line.startswith("PEAKS "))
    return steps, peaks, started


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="0.6B", choices=["test", "0.6B", "1.7B", "4B"])
    parser.add_argument("--engines", nargs="+", default=["torch", "vllm"])
    parser.add_argument("--pause-modes", nargs="+", default=["wait", "keep"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--examples", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--env",
        default=str(ROOT / "benchmarks" / "letters.py"),
        help="benchmarks/letters.py (its reward varies for a random model, so every step trains) or "
        "reverse_text (the recipe's own; a random model never writes its tags, every group is flat, nothing trains)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--model", "--url", "--out", "--pause-mode"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    from lib.models.qwen import QwenConfig, write_qwen

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        began = time.perf_counter()
        model = write_qwen(root / "model", QwenConfig(shape=args.shape))
        print(f"Qwen3 {args.shape} shape (bf16, tied) written in {time.perf_counter() - began:.0f} s")
        print(
            f"{args.examples} x {args.rollouts} rollouts of up to {args.max_tokens} tokens, {args.steps} steps"
        )
        head = f"{'engine':6} {'pause':5} {'step':>4} {'rollout':>8} {'train':>7} {'sync':>6} {'(pause':>7}"
        head += f" {'write':>6} {'load':>6} {'probe)':>7} {'GB out':>7} {'probe diff':>10} {'RSS GiB: trainer':>16} {'server':>6}"
        for engine in args.engines:
            for pause_mode in args.pause_modes:
                steps, peaks, started = rehearse(engine, pause_mode, model, root, args)
                print(
                    f"\n{engine}, pause {pause_mode}: server up in {started:.0f} s; peak RSS trainer ", end=""
                )
                print(
                    f"{peaks.get('trainer', 0) / GIB:.1f} GiB, server {peaks.get('server', 0) / GIB:.1f} GiB"
                )
                print(head)
                for s in steps:
                    print(
                        f"{engine:6} {pause_mode:5} {s['step']:4} {s['rollout_s']:8.1f} {s['train_s']:7.1f} "
                        f"{s['sync_s']:6.1f} {s.get('pause_s', 0):7.2f} {s.get('write_s', 0):6.2f} "
                        f"{s.get('load_s', 0):6.2f} {s.get('probe_s', 0):7.2f} {s.get('bytes', 0) / 1e9:7.2f} "
                        f"{s['probe_difference']:10.4f} {s.get('trainer_peak', 0) / GIB:16.1f} "
                        f"{s.get('server_peak', 0) / GIB:6.1f}"
                    )


if __name__ == "__main__":
    main()
