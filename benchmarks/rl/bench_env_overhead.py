"""Environment-layer overhead: what verifiers and plainrl's harness add to each rollout, beyond the model server.

Runs reverse_text episodes against the builtin server (started here with scripts/serve.py, or
attached with --url), once one at a time and once at --concurrency, and reports per rollout:
  - overhead: episode wall time minus the time its model calls spent in the server (the HTTP round
    trip of each call, as verifiers times it), median and mean over the episodes. One at a time this
    is the latency the environment layer adds to a rollout; at concurrency C it also holds the wait
    for the single event loop, busy with the other C - 1 episodes (about C x the CPU figure below);
  - client CPU: CPU time of this process (verifiers, the interception server, the harness, rendering
    for the train client) divided by the rollouts; the server runs in its own process, so none of it
    is model work. This is the environment layer's cost per rollout at that concurrency.
A warm-up round (not measured, same serving session) loads the tokenizer and opens the connections first.

Usage:
    python benchmarks/rl/bench_env_overhead.py                              # tiny model, train and eval client
    python benchmarks/rl/bench_env_overhead.py --model outputs/models/tiny --rollouts 256 --concurrency 64
    python benchmarks/rl/bench_env_overhead.py --url http://127.0.0.1:8000/v1 --model outputs/models/tiny
"""

import argparse
import asyncio
import atexit
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/


async def run(vf_env, tasks, ctx, rollouts: int, concurrency: int) -> tuple[list, float, float]:
    """Warm-up rollouts, then the measured ones, in one serving session as a training run has it."""
    from lib.orchestrator.envs import run_episode, serving

    semaphore = asyncio.Semaphore(concurrency)

    async def one(index: int):
        async with semaphore:
            began = time.perf_counter()
            episode = await run_episode(vf_env, tasks[index % len(tasks)], ctx)
            return time.perf_counter() - began, episode

    async with serving(vf_env):
        await asyncio.gather(*(one(i) for i in range(max(concurrency, 8))))
        cpu, wall = time.process_time(), time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(rollouts)))
        return results, time.process_time() - cpu, time.perf_counter() - wall


def measure(vf_env, tasks, ctx, rollouts: int, concurrency: int) -> dict:
    from lib.orchestrator.envs import episode_error

    results, cpu, wall = asyncio.run(run(vf_env, tasks, ctx, rollouts, concurrency))
    overheads, model_times = [], []
    for seconds, episode in results:
        model = sum(call.time.duration for trace in episode.traces for call in trace.calls)
        model_times.append(model)
        overheads.append(seconds - model)
    return {
        "rollouts": rollouts,
        "concurrency": concurrency,
        "errors": sum(episode_error(episode) is not None for _, episode in results),
        "wall_s": round(wall, 2),
        "overhead_ms_median": round(1000 * statistics.median(overheads), 2),
        "overhead_ms_mean": round(1000 * statistics.fmean(overheads), 2),
        "model_ms_median": round(1000 * statistics.median(model_times), 1),
        "client_cpu_ms_per_rollout": round(1000 * cpu / rollouts, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF model directory (default: a fresh tiny model)")
    parser.add_argument("--url", default=None, help="attach to this server (base URL ending in /v1)")
    parser.add_argument("--rollouts", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--clients", default="train,eval", help="comma-separated: train, eval")
    args = parser.parse_args()

    from lib.inference.launch import running_server
    from lib.models.tiny import write_tiny
    from lib.orchestrator.envs import EnvConfig, load_env, load_tasks, model_context
    from lib.sampling import SamplingConfig

    tmp = Path(tempfile.mkdtemp(prefix="bench_env_overhead_"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    model = args.model or str(write_tiny(tmp / "tiny"))
    env = EnvConfig(id="reverse_text", args='{"source": "synthetic"}', num_examples=64)
    vf_env = load_env(env)
    tasks = load_tasks(vf_env, env)
    sampling = SamplingConfig(max_tokens=args.max_tokens)
    if args.url is None:
        serving = running_server(
            model, engine="torch", extra_args=["--max-batch-size", str(args.concurrency)]
        )
    else:
        serving = contextlib.nullcontext(types.SimpleNamespace(url=args.url))
    with serving as server:
        for client in args.clients.split(","):
            ctx = model_context(server.url, model, sampling, train=client == "train", tokenizer=model)
            for rollouts, concurrency in [(args.rollouts // 8, 1), (args.rollouts, args.concurrency)]:
                result = measure(vf_env, tasks, ctx, rollouts, concurrency)
                print(json.dumps({"client": client, **result}), flush=True)


if __name__ == "__main__":
    main()
