"""Kept sets (top-k/top-p in RL): how big they are, what they cost on the wire, in the buffer and in the trainer,
and the on-policy bias of scoring without them.

1. The builtin engine, started with --return-sampling-mask, samples --requests prompts at top_p 0.9 / top_k 20
   (temperature 1). Per sampled token: the kept set's size (mean, median, share of singletons), the bytes of
   the answer's `sampling_mask` on the wire (compact JSON, as both engines send it) and in the buffer
   (lib/orchestrator/rollouts.py: int32 ids and an int32 count a token). The same tokens scored over the whole vocabulary
   give the importance ratio the trainer saw on-policy before kept sets: mean exp(logp_full - logp_kept).
2. The trainer's side: one micro-batch's forward and backward through lib/trainer/head.py next_token_scores without
   kept sets, with served ones and with recomputed ones (vLLM's CPU rules, a vocabulary sort a token),
   interleaved and repeated; medians and their ratios to the plain step. On a CPU shared with other work the
   seconds are noisy: read the ratios, which come from one run.

Usage:
    python benchmarks/inference/bench_kept_sets.py --model outputs/tiny/sft/weights/step_2000
    python benchmarks/inference/bench_kept_sets.py --model outputs/models/qwen-test --rows 1 --length 256
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/

TOP_K, TOP_P = 20, 0.9


def sample(model: str, requests: int, max_tokens: int) -> list[tuple[list[int], dict]]:
    """(prompt ids, /inference/v1/generate choice) pairs from a builtin engine that returns kept sets."""
    import httpx

    from lib import endpoint
    from lib.inference import launch
    from lib.models.load import load_tokenizer

    tokenizer = load_tokenizer(model)
    words = "reverse sort count the letters of plainrl hello world qwen tokens".split()
    prompts = [
        tokenizer.encode(" ".join(words[i % len(words) :] + words[: i % len(words)])) for i in range(requests)
    ]
    extra = ["--return-sampling-mask"]
    answers = []
    with launch.running_server(
        model, engine="torch", extra_args=extra, log_path=Path("/tmp/bench_kept_sets.log")
    ) as server:
        root = endpoint.root_url(server.url)
        for seed, prompt in enumerate(prompts):
            params = {
                "max_tokens": max_tokens,
                "temperature": 1.0,
                "top_k": TOP_K,
                "top_p": TOP_P,
                "logprobs": 0,
            }
            body = {"token_ids": prompt, "sampling_params": {**params, "seed": seed, "ignore_eos": True}}
            choice = httpx.post(f"{root}/inference/v1/generate", json=body, timeout=600).json()["choices"][0]
            answers.append((prompt, choice))
    return answers


def sizes_and_bias(model_name: str, answers) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.float32).eval()
    sizes, wire, tokens, ratios, rollout_bytes = [], 0, 0, [], []
    for prompt, choice in answers:
        masks, completion = choice["sampling_mask"], choice["token_ids"]
        sizes += [len(ids) for ids in masks]
        wire += len(json.dumps(masks, separators=(",", ":")))
        tokens += len(completion)
        # A rollout's two int32 arrays: a count for each of its tokens, prompt included, and the ids.
        rollout_bytes.append(4 * (len(prompt) + len(completion)) + 4 * sum(len(ids) for ids in masks))
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion]), use_cache=False).logits[
                0, len(prompt) - 1 : -1
            ]
        full = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        kept = torch.tensor([entry["logprob"] for entry in choice["logprobs"]["content"]])
        ratios += (full - kept).exp().tolist()
    mean = statistics.fmean(sizes)
    return {
        "sampled tokens": tokens,
        "kept set mean": round(mean, 2),
        "kept set median": statistics.median(sizes),
        "singletons": round(sum(s == 1 for s in sizes) / len(sizes), 3),
        "largest": max(sizes),
        "wire bytes/token": round(wire / tokens, 1),
        "buffer bytes/token": round(4 + 4 * mean, 1),
        "buffer bytes/rollout": round(statistics.fmean(rollout_bytes)),
        "ratio without kept sets": round(statistics.fmean(ratios), 4),
    }


def step_times(model_name: str, rows: int, length: int, repeats: int) -> dict:
    """Median seconds of one micro-batch's forward + backward, by kept-set source, and ratios to none."""
    import torch
    import torch.nn.functional as F

    from lib.models.load import ModelConfig
    from lib.sampling import kept_mask
    from lib.trainer.head import KeptSets, next_token_scores
    from lib.trainer.trainable import LoraConfig, load_trainable

    model, _, autocast = load_trainable(
        ModelConfig(name=model_name, dtype="float32"), LoraConfig(), device="cpu", world_size=1, packing=False
    )
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (rows, length), generator=generator)
    positions = torch.arange(length).repeat(rows, 1)
    mask = torch.zeros(rows, length, dtype=torch.bool)
    mask[:, length // 2 :] = True  # the second half: the completion
    with torch.no_grad():  # served sets: what the server would have kept of the same logits
        hidden = model.model(input_ids=input_ids, position_ids=positions, use_cache=False).last_hidden_state
        logits = (hidden[:, :-1] @ model.get_output_embeddings().weight.t()).float().flatten(0, 1)
        kept = kept_mask(logits, torch.full(logits.shape[:1], TOP_K), torch.full(logits.shape[:1], TOP_P))
    scored = mask[:, 1:].flatten()
    counts = F.pad(torch.where(mask[:, 1:], kept.sum(-1).reshape(rows, -1), 0), (1, 0)).int()
    served = KeptSets(ids=kept[scored].nonzero()[:, 1].int(), counts=counts)
    sources = {"none": None, "served": served, "recomputed": KeptSets(top_k=TOP_K, top_p=TOP_P)}
    seconds = {name: [] for name in sources}
    for _ in range(repeats):
        for name, sets in sources.items():
            model.zero_grad()
            began = time.perf_counter()
            with autocast():
                logp, _ = next_token_scores(model, input_ids, positions, mask, 1.0, sets)
            torch.where(logp.isfinite(), logp, 0.0).sum().backward()
            seconds[name].append(time.perf_counter() - began)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    return {
        "tokens scored": int(scored.sum()),
        **{f"{name} s": round(value, 3) for name, value in medians.items()},
        **{
            f"{name} / none": round(value / medians["none"], 2)
            for name, value in medians.items()
            if name != "none"
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", required=True, help="a model directory (the tiny SFT output, a Qwen shape)"
    )
    parser.add_argument("--requests", type=int, default=32, help="prompts sampled for the kept-set sizes")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens sampled per prompt")
    parser.add_argument("--rows", type=int, default=16, help="rows of the timed micro-batch")
    parser.add_argument("--length", type=int, default=192, help="tokens per row (the second half scored)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per kept-set source")
    args = parser.parse_args()
    import torch

    torch.manual_seed(0)
    answers = sample(args.model, args.requests, args.max_tokens)
    print(json.dumps({"model": args.model, **sizes_and_bias(args.model, answers)}))
    print(json.dumps({"model": args.model, **step_times(args.model, args.rows, args.length, args.repeats)}))


if __name__ == "__main__":
    main()
