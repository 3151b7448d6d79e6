"""Peak memory of one training micro-batch at Qwen's 151,936-row vocabulary: full logits against lib/trainer/head.py's chunks.

The model is the 2-layer Qwen3 test shape (hidden 256, random weights, float32 as the trainer keeps it).
One micro-batch is a forward and a backward of rl.py's loss on N loss tokens (one packed row), either
through full logits and loss.token_logp (before) or through the chunked output layer (after). Each case
runs in a fresh process whose address space is capped (--cap-gib), and the peak RSS of that process is
printed; a case that needs more than the cap reports it with the logits' arithmetic instead.

Usage:
    python benchmarks/trainer/bench_vocab_memory.py                 # 1k, 4k and 16k loss tokens
    python benchmarks/trainer/bench_vocab_memory.py --tokens 1024 2048 --cap-gib 16
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/
VOCAB = 151_936
GIB = 1024**3


def one_micro_batch(model_dir: str, tokens: int, chunked: bool, cap_gib: float) -> None:
    """In the child: one forward + backward, then the peak RSS as a JSON line."""
    resource.setrlimit(resource.RLIMIT_AS, (int(cap_gib * GIB), int(cap_gib * GIB)))
    import torch
    from transformers import AutoModelForCausalLM

    from lib.models.attention import use_packed_attention
    from lib.trainer.head import next_token_scores, use_chunked_head
    from lib.trainer.loss import LossConfig, policy_loss, token_logp

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    use_packed_attention(model)
    use_chunked_head(model)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    length = tokens + 1  # one prompt token, then `tokens` loss tokens
    input_ids = torch.randint(0, VOCAB, (1, length))
    position_ids = torch.arange(length)[None]
    mask = torch.ones(1, length, dtype=torch.bool)
    mask[0, 0] = False
    try:
        if chunked:
            logp, _ = next_token_scores(model, input_ids, position_ids, mask)
        else:
            logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
            logp = token_logp(logits, input_ids, 1.0, mask)
        advantages = torch.randn(1, length)
        loss, _ = policy_loss(logp, logp.detach() - 0.01, advantages, mask, tokens, LossConfig())
        loss.backward()
    except (MemoryError, RuntimeError) as error:
        print(json.dumps({"over_cap": str(error)[:120]}))
        return
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak": peak, "model": before}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", nargs="+", type=int, default=[1024, 4096, 16384])
    parser.add_argument("--cap-gib", type=float, default=20.0)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model_dir, tokens, mode = args.child
        return one_micro_batch(model_dir, int(tokens), mode == "chunked", args.cap_gib)

    from lib.models.qwen import QwenConfig, write_qwen

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_qwen(Path(tmp) / "qwen3-test", QwenConfig(shape="test", dtype="float32"))
        print(
            f"2-layer Qwen3 shape, vocabulary {VOCAB:,}, float32; address space capped at {args.cap_gib:g} GiB"
        )
        print(f"{'loss tokens':>11} {'full logits':>14} {'chunked':>10} {'one fp32 logits copy':>21}")
        for tokens in args.tokens:
            peaks = []
            for mode in ("full", "chunked"):
                command = [sys.executable, __file__, "--cap-gib", str(args.cap_gib), "--child"]
                done = subprocess.run(
                    [*command, str(model_dir), str(tokens), mode], capture_output=True, text=True
                )
                lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
                result = json.loads(lines[-1]) if lines else {"over_cap": done.stderr[-200:]}
                peaks.append(f"{result['peak'] / GIB:.2f} GiB" if "peak" in result else "over cap")
            print(f"{tokens:11,} {peaks[0]:>14} {peaks[1]:>10} {tokens * VOCAB * 4 / GIB:17.2f} GiB")


if __name__ == "__main__":
    main()
