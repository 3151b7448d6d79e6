"""Weight sync from the disk against in memory (lib/inference/weights/transfer.py): seconds per sync, the trainer's blocked seconds
and the bytes written to the run directory, on one model served in bf16.

Per round and path, what rl.py does after a step: disk = weights/step_N written (safetensors, atomic rename),
then every server reloads it (pause, reload_weights, fingerprint of the files, label, cache reset, resume);
memory = the weights copied out of the trainer in the served dtype, then broadcast into the server over gloo
and checked the same way (fingerprint of the copies). The trainer is blocked for the write (disk) or the copy
(memory) at max_async_level >= 1, and for the whole sync on-policy. Each weight moves a little every round,
so every fingerprint sees new weights. Prints the median of each figure over the rounds.

Usage:
    python benchmarks/inference/bench_weight_sync.py --model outputs/models/smollm2-135m-instruct
    python benchmarks/inference/bench_weight_sync.py --model outputs/models/smollm2-135m-instruct --engine vllm
    python scripts/qwen.py --qwen.shape 1.7B --out outputs/models/qwen3-1.7b-random
    python benchmarks/inference/bench_weight_sync.py --model outputs/models/qwen3-1.7b-random --master-dtype bfloat16
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face directory")
    parser.add_argument("--engine", default="torch", choices=["torch", "vllm"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--master-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the trainer's weights (bfloat16 fits a 1.7B shape beside its server in 24 GiB; float32 does not)",
    )
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lib.inference import launch
    from lib.inference.weights import reload, transfer
    from lib.trainer.servable import save_weights

    dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.master_dtype))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    figures = {"disk": [], "memory": []}
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        extra = ["--model.dtype", "bfloat16", "--max-model-len", "512", "--vllm.cpu-kv-cache-gib", "1"]
        extra += ["--vllm.weight-transfer-backend", transfer.GLOO]
        began = time.perf_counter()
        with launch.running_server(
            args.model,
            engine=args.engine,
            weights_root=run_dir,
            log_path=run_dir / "serve.log",
            extra_args=extra,
        ) as server:
            print(f"{args.engine} server up in {time.perf_counter() - began:.0f} s", flush=True)
            sender = transfer.Sender([server.url], None, "cpu", transfer.GLOO)
            for step in range(1, 2 * args.rounds + 1):
                with torch.no_grad():
                    for param in model.parameters():
                        param.add_(1e-3 * param.abs().mean())
                path_name = "disk" if step % 2 else "memory"
                began = time.perf_counter()
                if path_name == "disk":
                    path = save_weights(run_dir, step, model, tokenizer, dtype, keep=2)
                    blocked = time.perf_counter() - began
                    reload.reload_weights([server.url], path, None, f"step_{step}")
                    written = sum(file.stat().st_size for file in path.rglob("*") if file.is_file())
                else:
                    tensors = transfer.step_tensors(model, dtype)
                    blocked = time.perf_counter() - began
                    transfer.update_in_memory(
                        sender,
                        tensors,
                        tied="lm_head.weight" not in tensors,
                        label=f"step_{step}",
                        pause_mode="wait",
                    )
                    written = 0
                figures[path_name].append((time.perf_counter() - began, blocked, written))
            sender.close()
    for path_name, rows in figures.items():
        sync, blocked, written = (statistics.median(column) for column in zip(*rows))
        print(
            f"{args.engine} {path_name}: sync {sync:.2f} s, trainer blocked {blocked:.2f} s (async) / {sync:.2f} s "
            f"(on-policy), {written / 2**20:.0f} MiB written a step, rounds {[round(r[0], 2) for r in rows]}"
        )


if __name__ == "__main__":
    main()
