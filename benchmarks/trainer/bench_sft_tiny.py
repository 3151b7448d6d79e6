"""Tiny CPU SFT on synthetic reverse_text: the greedy reward curve (steps, wall time, reward).

Trains the tiny model with scripts/sft.py's main() and configs/tiny/sft.toml, saving weights every
--eval-every steps, then decodes held-out prompts greedily from each saved step and scores them like
the reverse_text environment: SequenceMatcher ratio of the first <reversed_text> block (stripped)
against the reversed text. Training data comes from lib.orchestrator.envs.sft_conversations (the reverse_text
taskset's ideal answers) when lib.orchestrator.envs has it, else from this directory's generator (same prompt and
reply format, 10-40 characters of English-looking words) through a JSONL file; the held-out prompts
use another seed.

Usage:
    python benchmarks/trainer/bench_sft_tiny.py                          # fresh tiny model in a temp dir
    python benchmarks/trainer/bench_sft_tiny.py --eval-every 250 -- --steps 1500 --optim.lr 3e-3
"""

import argparse
import atexit
import dataclasses
import difflib
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/
from benchmarks.common import ROOT  # noqa: E402

ANSWER = re.compile(r"<reversed_text>(.*?)</reversed_text>", re.DOTALL)


def reward(reply: str, text: str) -> float:
    match = ANSWER.search(reply)
    answer = match.group(1).strip() if match else ""
    return difflib.SequenceMatcher(None, answer, text[::-1]).ratio()


def greedy_rewards(model_dir: Path, conversations: list[list[dict]], max_new_tokens: int) -> list[float]:
    """Greedy replies to each conversation's system + user turns, scored against the user text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [
        tokenizer.apply_chat_template(c[:2], tokenize=False, add_generation_prompt=True)
        for c in conversations
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
    replies = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return [reward(reply, c[1]["content"]) for reply, c in zip(replies, conversations)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="Hugging Face dir (default: a fresh tiny model)")
    parser.add_argument("--eval-every", type=int, default=250, help="steps between evaluated weights")
    parser.add_argument("--num-eval", type=int, default=128, help="held-out prompts")
    parser.add_argument("--min-chars", type=int, default=10, help="local generator: shortest text")
    parser.add_argument("--max-chars", type=int, default=40, help="local generator: longest text")
    parser.add_argument("sft_flags", nargs="*", help="extra scripts/sft.py flags (after --)")
    args = parser.parse_args()

    import lib.orchestrator.envs
    from benchmarks.trainer.bench_packing import load_sft, reverse_text_conversations, write_jsonl
    from lib.config import parse
    from lib.models.tiny import write_tiny
    from lib.trainer.checkpoint import step_dirs, step_of

    tmp = Path(tempfile.mkdtemp(prefix="bench_sft_tiny_"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # its checkpoints run to gigabytes
    model = args.model or str(write_tiny(tmp / "tiny"))
    sft = load_sft()
    flags = [
        "@",
        str(ROOT / "configs/tiny/sft.toml"),
        "--model.name",
        model,
        "--output-dir",
        str(tmp / "run"),
    ]
    flags += ["--checkpoint-every", str(args.eval_every), "--keep-checkpoints", "1000"]
    if hasattr(lib.orchestrator.envs, "sft_conversations"):
        cfg = parse(sft.Config, flags + args.sft_flags)
        train = lib.orchestrator.envs.sft_conversations(cfg.data)
        held_out = lib.orchestrator.envs.sft_conversations(
            dataclasses.replace(cfg.data, num_examples=args.num_eval, seed=12345)
        )
    else:
        print(
            "lib.orchestrator.envs has no sft_conversations yet: using benchmarks/trainer/bench_packing.py's generator"
        )
        count = parse(sft.Config, flags + args.sft_flags).data.num_examples
        train = reverse_text_conversations(count if count > 0 else 20000, 0, args.min_chars, args.max_chars)
        held_out = reverse_text_conversations(args.num_eval, 12345, args.min_chars, args.max_chars)
        data = write_jsonl(train, tmp / "train.jsonl")
        cfg = parse(sft.Config, flags + ["--data.id", str(data), *args.sft_flags])
    train_texts = {c[1]["content"] for c in train}
    overlap = sum(c[1]["content"] in train_texts for c in held_out)

    started = time.perf_counter()
    result = sft.main(cfg)
    wall = time.perf_counter() - started
    train_seconds = [0.0]
    for metrics in result["history"]:
        train_seconds.append(train_seconds[-1] + metrics["perf/step_seconds"])

    print(f"\nheld-out prompts: {len(held_out)} ({overlap} also in the training data)")
    print(f"{'step':>6} {'train s':>8} {'reward':>7} {'perfect':>8}")
    longest = max(len(c[1]["content"]) for c in held_out)
    for path in step_dirs(result["run_dir"] / "weights"):
        scores = greedy_rewards(path, held_out, max_new_tokens=2 * longest + 40)
        perfect = sum(s == 1.0 for s in scores) / len(scores)
        step = step_of(path)
        print(f"{step:>6} {train_seconds[step]:>8.1f} {sum(scores) / len(scores):>7.3f} {perfect:>8.2f}")
    print(f"sft.py wall time (load, tokenize, train, save): {wall:.1f} s")


if __name__ == "__main__":
    main()
