"""The limit this machine sets: a plain single-process RL loop on the RL benchmark's model and batch.

Each step takes bench_rl_vs_trl.py's workload (bench_trl_grpo.make_prompts and reward: 8 prompts x 8
completions of at most 64 tokens, temperature 1), generates with transformers' generate and its KV
cache, scores, and takes one policy-gradient step (REINFORCE with the group-mean baseline, token mean,
AdamW at lr 1e-4) on the whole padded batch. No server, no HTTP, no episodes, no packing, no chunked head:
what is left is model work and transformers' own Python per token.

It prints, per step and as median / min / max over the timed steps: new tokens per second of generation
(completion tokens up to and including the end-of-sequence token, over generate's seconds) and trained
tokens per second of the step (prompt and completion tokens, as plainrl's perf/tokens_per_second counts
them, over the forward, backward and optimizer step's seconds). The last line is JSON.

Usage:
    python scripts/tiny.py --out /tmp/tiny
    python scripts/sft.py @ configs/tiny/sft.toml --model.name /tmp/tiny --output-dir /tmp/sft150 --steps 150
    python benchmarks/rl/bench_plain_loop.py /tmp/sft150/weights/step_150 --steps 10 --threads 1
"""

import argparse
import contextlib
import json
import statistics
import time

from bench_trl_grpo import make_prompts, reward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="Hugging Face directory of the (SFT-warmed) tiny model.")
    parser.add_argument("--steps", type=int, default=10, help="Timed steps.")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed steps before them.")
    parser.add_argument("--examples-per-step", type=int, default=8)
    parser.add_argument("--rollouts-per-example", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64, help="Most completion tokens.")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default).")
    parser.add_argument(
        "--bf16", action="store_true", help="bf16 autocast over float32 weights, as plainrl's trainer."
    )
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    group = args.rollouts_per_example
    prompts = make_prompts((args.warmup + args.steps) * args.examples_per_step)

    def compute():
        return torch.autocast("cpu", dtype=torch.bfloat16) if args.bf16 else contextlib.nullcontext()

    rows = []
    for step in range(args.warmup + args.steps):
        chats = prompts[step * args.examples_per_step : (step + 1) * args.examples_per_step]
        texts = [
            tokenizer.apply_chat_template(c["prompt"], tokenize=False, add_generation_prompt=True)
            for c in chats
            for _ in range(group)
        ]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        prompt_length = batch.input_ids.shape[1]

        # -------------------------------------------------------- generate (KV cache)
        model.eval()
        generate_began = time.perf_counter()
        with torch.no_grad(), compute():
            sequences = model.generate(
                **batch,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.max_tokens,
                pad_token_id=tokenizer.pad_token_id,
            )  # (B, P + C)
        generate_seconds = time.perf_counter() - generate_began
        completion = sequences[:, prompt_length:]  # (B, C)
        # A completion ends at its first end-of-sequence token, which it keeps; what follows is padding.
        is_eos = completion == tokenizer.eos_token_id  # (B, C)
        after_eos = (is_eos.cumsum(dim=1) - is_eos.long()) > 0  # (B, C)
        completion_mask = ~after_eos  # (B, C)

        # -------------------------------------------------------- score
        answers = tokenizer.batch_decode(
            completion.masked_fill(after_eos, tokenizer.pad_token_id), skip_special_tokens=True
        )
        rewards = torch.tensor([reward(a, chats[i // group]["text"]) for i, a in enumerate(answers)])  # (B,)
        adv = (rewards.view(-1, group) - rewards.view(-1, group).mean(dim=1, keepdim=True)).view(-1)  # (B,)

        # -------------------------------------------------------- one policy-gradient step
        model.train()
        train_began = time.perf_counter()
        attention_mask = torch.cat([batch.attention_mask, completion_mask.long()], dim=1)  # (B, P + C)
        with compute():
            logits = model(input_ids=sequences, attention_mask=attention_mask).logits[
                :, prompt_length - 1 : -1
            ]  # (B, C, V)
        logp = (
            torch.log_softmax(logits.float(), dim=-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        )  # (B, C)
        loss = -(adv.unsqueeze(1) * logp * completion_mask).sum() / completion_mask.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train_seconds = time.perf_counter() - train_began

        new_tokens = int(completion_mask.sum())
        trained_tokens = new_tokens + int(batch.attention_mask.sum())
        row = {
            "generate_seconds": generate_seconds,
            "train_seconds": train_seconds,
            "new_tokens_per_second": new_tokens / generate_seconds,
            "trained_tokens_per_second": trained_tokens / train_seconds,
            "new_tokens": new_tokens,
            "reward_mean": float(rewards.mean()),
        }
        print(json.dumps({"step": step + 1, **{k: round(v, 4) for k, v in row.items()}}), flush=True)
        if step >= args.warmup:
            rows.append(row)

    def spread(name: str) -> dict:
        values = [row[name] for row in rows]
        return {
            "median": round(statistics.median(values), 4),
            "min": round(min(values), 4),
            "max": round(max(values), 4),
        }

    names = (
        "new_tokens_per_second",
        "trained_tokens_per_second",
        "generate_seconds",
        "train_seconds",
        "new_tokens",
    )
    print(
        json.dumps(
            {
                "threads": torch.get_num_threads(),
                "compute": "bf16 autocast" if args.bf16 else "float32",
                "steps_timed": len(rows),
                **{n: spread(n) for n in names},
            }
        )
    )


if __name__ == "__main__":
    main()
