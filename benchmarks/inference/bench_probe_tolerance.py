"""How far a bf16 server's logprobs are from the trainer's, at a real Qwen3 shape: the figure behind rl.py's
bf16 probe tolerance (inference.probe_tolerance).

Random weights give flat next-token distributions and small differences, so the model is first SFT'd
briefly (reversing short strings), and copies of it are sharpened (the final norm's weight scaled, which
scales every logit) until its outputs are as peaked as a trained model's. Then, per engine (the builtin one and
vLLM's CPU build, both serving bfloat16), rl.py's probe runs on several prompts and the trainer scores the
same tokens with its float32 weights twice: in float32 and under bf16 autocast (how a GPU trainer computes).
It prints the mean |logprob difference| per prompt, its mean and its largest value.

Usage:
    python benchmarks/inference/bench_probe_tolerance.py              # 0.6B shape, 20 SFT steps, sharpened x4 and x16
    python benchmarks/inference/bench_probe_tolerance.py --shape test --sft-steps 30
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "Reverse the text character-by-character: plainrl",
    "def add(a, b):\n    return",
    "Once upon a time, in a land far away,",
    "<think>\nThe user wants a list.\n</think>\n\n1.",
    "Qwen3 uses grouped-query attention with",
]


def reversal_chats(path: Path, count: int = 512) -> Path:
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz "
    with open(path, "w") as out:
        for _ in range(count):
            text = "".join(rng.choice(letters) for _ in range(rng.randint(8, 24))).strip() or "plainrl"
            chat = [
                {"role": "user", "content": f"Reverse: {text}"},
                {"role": "assistant", "content": text[::-1]},
            ]
            out.write(json.dumps({"messages": chat}) + "\n")
    return path


def differences(server_url: str, model, tokenizer) -> dict[str, list[float]]:
    import torch

    from lib.inference.weights import probing

    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    fp32 = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    found = {"float32": [], "bf16 autocast": [], "server logp": []}
    for text in PROMPTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        probe = probing.probe(server_url, "policy", ids, None)
        for name, autocast in (("float32", fp32), ("bf16 autocast", bf16)):
            trainer = probing.trainer_logprobs(model, autocast, ids, probe.completion_ids)
            found[name].append(sum(abs(a - b) for a, b in zip(probe.logprobs, trainer)) / len(trainer))
        found["server logp"].append(sum(probe.logprobs) / len(probe.logprobs))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="0.6B", choices=["test", "0.6B", "1.7B", "4B"])
    parser.add_argument("--sft-steps", type=int, default=20)
    parser.add_argument("--engines", nargs="+", default=["torch", "vllm"])
    parser.add_argument("--sharpen", nargs="*", type=float, default=[4.0, 16.0])
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.common import load_script
    from lib.config import parse
    from lib.inference import launch
    from lib.inference.weights import reload
    from lib.models.qwen import QwenConfig, write_qwen
    from lib.trainer.head import use_chunked_head
    from lib.trainer.servable import write_hf_dir

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = write_qwen(root / "base", QwenConfig(shape=args.shape))
        began = time.perf_counter()
        sft = load_script("sft")
        sft_args = ["--model.name", str(base), "--data.id", str(reversal_chats(root / "chats.jsonl"))]
        sft_args += ["--output-dir", str(root / "sft"), "--steps", str(args.sft_steps), "--batch-size", "8"]
        sft_args += ["--seq-len", "256", "--optim.lr", "3e-4", "--checkpoint-every", str(args.sft_steps)]
        sft_args += ["--log-every", "5"]
        sft.main(parse(sft.Config, sft_args))
        warmed = root / "sft" / "weights" / f"step_{args.sft_steps}"
        print(f"SFT: {args.sft_steps} steps in {time.perf_counter() - began:.0f} s")
        models = {"random": base, f"SFT {args.sft_steps}": warmed}
        for factor in args.sharpen:  # the final norm scales every logit: a trained model's peaked outputs
            model = AutoModelForCausalLM.from_pretrained(warmed, dtype=torch.float32)
            with torch.no_grad():
                model.model.norm.weight.mul_(factor)
            tokenizer = AutoTokenizer.from_pretrained(warmed)
            models[f"SFT x{factor:g}"] = root / f"sharpened-{factor:g}"
            write_hf_dir(models[f"SFT x{factor:g}"], model.state_dict(), model, tokenizer, torch.float32)
        rows = []
        for engine in args.engines:
            extra = ["--model.dtype", "bfloat16", "--max-model-len", "1024", "--vllm.cpu-kv-cache-gib", "1"]
            extra += ["--served-model-name", "policy", "--weights-root", str(root)]
            log = root / f"{engine}.log"
            with launch.running_server(str(base), engine=engine, log_path=log, extra_args=extra) as server:
                for label, model_dir in models.items():
                    reload.reload_weights([server.url], model_dir, None, label)
                    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
                    use_chunked_head(model)  # the trainer scores tokens through it
                    tokenizer = AutoTokenizer.from_pretrained(model_dir)
                    rows.append((label, engine, differences(server.url, model, tokenizer)))
        print(
            f"\nQwen3 {args.shape} shape, server bf16, trainer float32 weights; mean |logprob difference| per prompt"
        )
        print(
            f"{'model':10} {'engine':6} {'server logp':>11}  {'float32 mean':>12} {'max':>7}  {'bf16 mean':>9} {'max':>7}"
        )
        for label, engine, found in rows:
            fp32, bf16 = found["float32"], found["bf16 autocast"]
            print(
                f"{label:10} {engine:6} {sum(found['server logp']) / len(PROMPTS):11.2f}  "
                f"{sum(fp32) / len(fp32):12.4f} {max(fp32):7.4f}  {sum(bf16) / len(bf16):9.4f} {max(bf16):7.4f}"
            )


if __name__ == "__main__":
    main()
