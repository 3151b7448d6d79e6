"""TRL baseline: GRPOTrainer on CPU, tiny model, a reverse_text-like task; prints seconds per step.

The reference point plainrl's own RL benchmark is compared with: same tiny model, prompts, group size,
batch and completion length. Each optimizer step samples 8 prompts x 8 completions (64 tokens at most,
as bench_rl_vs_trl.py passes; temperature 1), scores them, and takes one AdamW step at lr 1e-4
(generation_batch_size = the train batch, so one generation per optimizer step, num_iterations 1, no
reference model: beta 0). Every completion is trained on, flat groups included (zero advantages).
Seconds per step are the intervals between consecutive optimizer-step ends after the warm-up steps,
so they include generation, scoring, the forward/backward and TRL's own bookkeeping; the last line
is JSON with their mean and median, and rollouts per second from each.

On the random tiny model every completion scores 0, so every group is flat: TRL still runs the
forward/backward (with zero advantages). Compare like with like: give plainrl the same work (train
on flat batches too), or point both at an SFT-warmed checkpoint whose groups carry signal. On a
shared 2-core machine one busy neighbour stalls torch's 2-thread pool badly; --threads 1 is steadier.

It runs in a throw-away virtualenv with TRL, never in plainrl's (plainrl does not depend on TRL), and
imports nothing from plainrl. make_prompts() and reward() are plain Python so plainrl's side of the
comparison can load this file and use the very same prompts and reward.

Usage:
    python3 -m venv /tmp/trlvenv
    /tmp/trlvenv/bin/pip install torch==2.13.0 && /tmp/trlvenv/bin/pip install trl==1.16.0 transformers==5.19.0
    python scripts/tiny.py --out /tmp/tinybench
    /tmp/trlvenv/bin/python benchmarks/rl/bench_trl_grpo.py /tmp/tinybench --steps 20 --warmup 2
"""

import argparse
import difflib
import json
import os
import random
import re
import statistics
import time

SYSTEM_PROMPT = "Reverse the text character-by-character. Put your answer in <reversed_text> tags."
WORDS = (
    "the of and to in is was for on as with by at from his her an were are which this be or had "
    "not but first one their its new after who they have two been has more also other all time "
    "city year world river house small water light early music night field north story green"
).split()
ANSWER = re.compile(r"<reversed_text>(.*?)</reversed_text>", re.DOTALL)


def make_prompts(count: int, seed: int = 0) -> list[dict]:
    """Short English-looking texts (2-4 common words) as chat prompts, with the text kept for scoring."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 4)))
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]
        prompts.append({"prompt": messages, "text": text})
    return prompts


def reward(completion: str, text: str) -> float:
    """SequenceMatcher ratio of the first <reversed_text> content (stripped, "" if none) vs text[::-1]."""
    match = ANSWER.search(completion)
    answer = match.group(1).strip() if match else ""
    return difflib.SequenceMatcher(None, answer, text[::-1]).ratio()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "model_dir", help="Hugging Face directory of the tiny model (scripts/tiny.py writes one)."
    )
    parser.add_argument("--steps", type=int, default=20, help="Timed optimizer steps.")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed optimizer steps before them.")
    parser.add_argument("--examples-per-step", type=int, default=8, help="Prompts per step.")
    parser.add_argument(
        "--rollouts-per-example", type=int, default=8, help="Completions per prompt (group size)."
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="Most completion tokens.")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate.")
    parser.add_argument("--seed", type=int, default=0, help="TRL's seed (sampling, data order).")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default).")
    parser.add_argument(
        "--bf16", action="store_true", help="bf16 autocast over float32 weights (Trainer's bf16=True)."
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass (1 = off).")
    parser.add_argument("--top-k", type=int, default=0, help="Top-k filtering (0 = off, TRL's convention).")
    parser.add_argument(
        "--prompts",
        help="A JSONL file of {prompt: chat messages, text: the text to reverse}, one line per prompt in the "
        "order the steps take them (default: make_prompts()).",
    )
    parser.add_argument(
        "--save-every", type=int, default=0, help="Save the weights every N steps (0 = never)."
    )
    parser.add_argument(
        "--output-dir",
        default="/tmp/bench_trl_grpo",
        help="TRL's output directory (its checkpoint-N directories when --save-every is given).",
    )
    args = parser.parse_args()

    # No hub access on these machines: never try it.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_DISABLED", "true")
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    if args.threads:
        torch.set_num_threads(args.threads)
    total_steps = args.warmup + args.steps
    needed = total_steps * args.examples_per_step
    if args.prompts:
        with open(args.prompts) as lines:
            prompts = [json.loads(line) for line in lines][:needed]
        if len(prompts) < needed:
            raise SystemExit(f"{args.prompts} has {len(prompts)} prompts; {needed} steps' worth are needed.")
    else:
        prompts = make_prompts(needed)
    dataset = datasets.Dataset.from_list(prompts)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)

    def reverse_text_reward(completions, text, **kwargs):
        return [reward(completion[-1]["content"], t) for completion, t in zip(completions, text)]

    batch = args.examples_per_step * args.rollouts_per_example
    config = trl.GRPOConfig(
        output_dir=args.output_dir,
        use_cpu=True,
        bf16=args.bf16,
        seed=args.seed,
        max_steps=total_steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=args.rollouts_per_example,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        top_p=args.top_p,
        top_k=args.top_k,
        beta=0.0,
        num_iterations=1,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="steps" if args.save_every else "no",
        save_steps=args.save_every or 500,
        save_only_model=True,
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )

    step_ends: list[float] = []
    rewards: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            step_ends.append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])

    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reverse_text_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start

    timed = step_ends[args.warmup - 1 :] if args.warmup else [start, *step_ends]
    intervals = [b - a for a, b in zip(timed, timed[1:])]
    seconds_per_step = sum(intervals) / len(intervals)
    result = {
        "framework": "trl",
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "compute": "bf16 autocast" if args.bf16 else "float32",
        "steps_timed": len(intervals),
        "warmup_steps": args.warmup,
        "rollouts_per_step": batch,
        "max_tokens": args.max_tokens,
        "seconds_per_step": round(seconds_per_step, 4),
        "rollouts_per_second": round(batch / seconds_per_step, 2),
        # The CPU may be shared: the median step is the figure least disturbed by other processes.
        "seconds_per_step_median": round(statistics.median(intervals), 4),
        "rollouts_per_second_median": round(batch / statistics.median(intervals), 2),
        "wall_seconds": round(wall, 2),
        "reward_mean": round(sum(rewards) / len(rewards), 4) if rewards else None,
        "reward_last10": round(statistics.fmean(rewards[-10:]), 4) if rewards else None,
        "rewards": [round(reward, 4) for reward in rewards],  # each step's mean, warm-up steps included
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
