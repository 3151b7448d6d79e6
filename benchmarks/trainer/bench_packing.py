"""Packing benchmark: SFT training tokens/s with and without packing, same samples, same run.

Runs scripts/sft.py's main() twice on the tiny model over synthetic reverse_text conversations whose
texts vary in length like paragraphs (the SFT data of the seed recipe is Wikipedia paragraphs), once
with `packing` (each micro-batch's samples share rows of seq_len tokens, positions restart per sample)
and once without (one row per sample, padded to the longest in its micro-batch). Tokens/s counts real
tokens only (no padding) and is the median over the steps after the warm-up ones.

Usage:
    python benchmarks/trainer/bench_packing.py                      # builds the tiny model in a temp dir
    python benchmarks/trainer/bench_packing.py --model outputs/models/tiny --steps 12 --max-words 120
"""

import argparse
import atexit
import importlib.util
import json
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/
from benchmarks.common import ROOT  # noqa: E402

SYSTEM_PROMPT = "Reverse the text character-by-character. Put your answer in <reversed_text> tags."
WORDS = (
    "the of and to in is was for on as with by at from his her an were are which this be or had not but "
    "first one their its new after who they have two been has more also other all time city year world "
    "river house small water light early music night field north story green state school during team "
    "known later began under between three family began church found series place public built become"
).split()


def reverse_text_conversations(count: int, seed: int, min_chars: int, max_chars: int) -> list[list[dict]]:
    """English-looking texts of min..max characters (whole words) with their ideal reversed answers."""
    rng = random.Random(seed)
    conversations = []
    for _ in range(count):
        length, words = rng.randint(min_chars, max_chars), []
        while len(" ".join(words)) < length:
            words.append(rng.choice(WORDS) + ("," if rng.random() < 0.06 else ""))
        text = " ".join(words)[:length].rstrip(" ,").capitalize() + "."
        conversations.append(
            [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": text},
                {"role": "assistant", "content": f"<reversed_text>\n{text[::-1]}\n</reversed_text>"},
            ]
        )
    return conversations


def write_jsonl(conversations: list[list[dict]], path: Path) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def load_sft():
    spec = importlib.util.spec_from_file_location("sft_script", ROOT / "scripts" / "sft.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # tyro reads the Config's source through its module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="Hugging Face dir (default: a fresh tiny model)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    parser.add_argument(
        "--repeats", type=int, default=2, help="alternating runs per setting; the best counts"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--min-chars", type=int, default=20, help="shortest text to reverse")
    parser.add_argument("--max-chars", type=int, default=600, help="longest text (a paragraph)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from lib.config import parse
    from lib.models.tiny import write_tiny
    from lib.orchestrator.data import load_conversations, tokenize_all
    from lib.orchestrator.envs import EnvConfig

    tmp = Path(tempfile.mkdtemp(prefix="bench_packing_"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # its checkpoints run to gigabytes
    model = args.model or str(write_tiny(tmp / "tiny"))
    conversations = reverse_text_conversations(
        args.batch_size * args.steps, 0, args.min_chars, args.max_chars
    )
    data = write_jsonl(conversations, tmp / "data.jsonl")
    sft = load_sft()
    # Alternating on/off runs, best median of each: other load on the machine only ever slows a run down.
    speeds = {True: [], False: []}
    for repeat in range(args.repeats):
        for packing in (True, False):
            flags = [
                "--model.name", model, "--data.id", str(data), "--steps", str(args.steps),
                "--batch-size", str(args.batch_size), "--micro-batch-size", str(args.micro_batch_size),
                "--seq-len", str(args.seq_len), "--output-dir", str(tmp / f"run_{repeat}_{packing}"),
                "--checkpoint-every", str(10 * args.steps), "--log-every", str(10 * args.steps),
                "--optim.lr", "1e-3", "--packing" if packing else "--no-packing",
            ]  # fmt: skip
            history = sft.main(parse(sft.Config, flags))["history"]
            speeds[packing].append(
                statistics.median(m["perf/tokens_per_second"] for m in history[args.warmup :])
            )

    tokenizer = AutoTokenizer.from_pretrained(model)
    samples, _ = tokenize_all(tokenizer, load_conversations(EnvConfig(id=str(data))), args.seq_len)
    lengths = sorted(len(ids) for ids, _ in samples)
    on, off = max(speeds[True]), max(speeds[False])
    print()
    print(
        f"data: {len(lengths)} samples of {lengths[0]} / {lengths[len(lengths) // 2]} / {lengths[-1]} tokens (min / median / max)"
    )
    print(
        f"micro-batch {args.micro_batch_size} samples, seq_len {args.seq_len}, {args.steps} steps x {args.repeats}"
    )
    print(f"packing on : {on:9.0f} tokens/s   (runs: {', '.join(f'{s:.0f}' for s in speeds[True])})")
    print(f"packing off: {off:9.0f} tokens/s   (runs: {', '.join(f'{s:.0f}' for s in speeds[False])})")
    print(f"speed-up   : {on / off:.2f}x")


if __name__ == "__main__":
    main()
