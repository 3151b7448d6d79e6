"""Supervised warm-up: next-token loss on assistant tokens only, with packing, LoRA and FSDP2.

Data comes from a plainrl taskset (its ideal answers), a local .jsonl, .json or .parquet file (records
with `messages`, or with `prompt` and `completion`; checked before the run directory is made), or a
Hugging Face dataset id. Conversations go through the
tokenizer's chat template; only the assistant turns (through their end-of-turn token) carry loss. Each
step takes the next batch_size samples of a seeded, per-epoch shuffled stream; the loss is the mean
over every assistant token of the step (all micro-batches and ranks together), so packing,
micro-batching and the number of ranks change the arithmetic order, not the result.

Packing puts several samples in one row of seq_len tokens; positions restart at 0 for each sample and
transformers masks attention across samples from those restarts. Master weights and AdamW state stay
in float32; on GPU, and on CPUs with native bf16 (model.autocast), the forward runs under bfloat16
autocast (FSDP2 on GPUs gathers bf16 parameters). LoRA adapters are merged into weights/step_N, so the
saved model is a plain Hugging Face model.

Writes under output_dir: run.lock (the pid that holds it: a second run there is refused), config.toml,
provenance.json (git revision, package versions), base.json (the model it starts from and sha256s of its
weights and config: a LoRA `--resume` refuses another), tb/ (loss, lr, grad norm, tokens/s; wandb too with
--wandb.project), loss_curve.png (at each checkpoint and at the end), weights/step_N (servable by serve.py and
vLLM) and checkpoints/step_N (trainable weights, optimizer, scheduler, data position, RNG; with them
`--resume` continues bit for bit). Both are written to a temporary name and renamed into place.

Usage:
    python scripts/sft.py @ configs/tiny/sft.toml                                  # CPU (after `make tiny`)
    python scripts/sft.py @ configs/reverse_text/sft.toml                          # one GPU
    torchrun --nproc-per-node 8 scripts/sft.py @ configs/reverse_text/sft.toml     # FSDP2 on 8 GPUs
    torchrun --nproc-per-node 2 scripts/sft.py @ configs/tiny/sft.toml             # 2 CPU processes (gloo)
    python scripts/sft.py @ configs/tiny/sft.toml --resume                          # continue a stopped run
"""

import dataclasses
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # finds lib/ outside the virtualenv too
import lib.venv  # noqa: F401  (first: says which python to use when the dependencies are missing)
from lib.config import StopAfterStep, UserError, parse, run_main
from lib.log import WandbConfig
from lib.models.load import ModelConfig
from lib.orchestrator.envs import EnvConfig
from lib.trainer.optim import OptimConfig
from lib.trainer.trainable import LoraConfig


@dataclasses.dataclass
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The model to fine-tune (dtype auto trains float32 weights, with bf16 autocast where model.autocast says)."""
    data: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    """Training data: data.id is a local .jsonl/.json/.parquet file (records with `messages`, or `prompt` and
    `completion`), a Hugging Face dataset id (contains `/`), or a taskset id."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """AdamW and the learning-rate schedule."""
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    """LoRA adapters (rank 0 = full fine-tuning); merged into the saved weights."""
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    """Weights & Biases logging beside tensorboard (off unless wandb.project is set)."""
    steps: int = 100
    """Optimizer steps."""
    batch_size: int = 32
    """Samples per optimizer step (all ranks together)."""
    micro_batch_size: int = 8
    """Samples per forward/backward on one rank; batch_size / (micro_batch_size * ranks) accumulations."""
    seq_len: int = 4096
    """Tokens per packed row; longer samples are truncated."""
    packing: bool = True
    """Pack each micro-batch's samples into rows of seq_len (no attention across samples); off = one row each."""
    activation_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    output_dir: Path = Path("outputs/sft")
    """Run directory: config.toml, tb/, weights/, checkpoints/."""
    checkpoint_every: int = 50
    """Write weights and a resumable checkpoint every N steps (and at the end)."""
    keep_checkpoints: int = 2
    """weights/step_N and checkpoints/step_N directories kept (older ones are deleted)."""
    resume: bool = False
    """Continue from the newest complete checkpoint in output_dir (step 0 if there is none yet), with the
    run's own config: `@` presets are ignored, flags change it (recorded in resumes.jsonl)."""
    log_every: int = 10
    """Print a console line for the first step and every N steps (tensorboard gets every step)."""
    seed: int = 0
    """Seed of initialisation-time randomness (LoRA) and of the data order."""
    peer_timeout: float = 120.0
    """Several processes: a rank ends when a peer sends no heartbeat for this many seconds (a node
    killed, frozen or cut off); a slow step on a live peer never counts."""

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1 or self.micro_batch_size < 1 or self.seq_len < 2:
            raise UserError("steps, batch_size and micro_batch_size must be >= 1 and seq_len >= 2.")
        if self.batch_size % self.micro_batch_size:
            raise UserError(
                f"batch_size {self.batch_size} is not divisible by micro_batch_size {self.micro_batch_size}."
            )
        if self.checkpoint_every < 1 or self.keep_checkpoints < 1 or self.log_every < 1:
            raise UserError("checkpoint_every, keep_checkpoints and log_every must be at least 1.")
        if self.peer_timeout <= 0:
            raise UserError("peer_timeout must be a positive number of seconds.")


def main(cfg: Config) -> dict:
    """Trains and returns {"run_dir", "weights" (the last weights/step_N), "history" (metrics per step)}."""
    import time

    import torch

    from lib import dist, rundir
    from lib.config import to_dict
    from lib.log import RunLog, plural, say
    from lib.models.load import check_model_name, load_tokenizer, resolve_device
    from lib.orchestrator.data import batch_indices, check_data, load_conversations, tokenize_all
    from lib.plot import plot_curve
    from lib.provenance import write_provenance
    from lib.trainer.checkpoint import load_checkpoint, open_run, save_checkpoint, step_of
    from lib.trainer.head import next_token_scores
    from lib.trainer.optim import build_optimizer, optimizer_step
    from lib.trainer.packing import sft_rows
    from lib.trainer.servable import save_weights
    from lib.trainer.trainable import load_trainable

    # ------------------------------------------------------------ config and run directory
    rank, _, world_size = dist.world()
    is_main = rank == 0
    if cfg.batch_size % (cfg.micro_batch_size * world_size):
        raise UserError(
            f"batch_size {cfg.batch_size} is not divisible by micro_batch_size {cfg.micro_batch_size} "
            f"x {world_size} ranks."
        )
    check_model_name(cfg.model.name)
    check_data(cfg.data)  # a typo or a bad data file ends the run here, before any run directory
    run_dir = cfg.output_dir
    # Every rank joins first: rank 0 alone claims the run directory, the others take its answer (open_run).
    device = dist.init(resolve_device(cfg.model), cfg.peer_timeout)
    resume_from = open_run(cfg, say)
    if resume_from and step_of(resume_from) >= cfg.steps:
        last = run_dir / rundir.WEIGHTS / resume_from.name
        done = f"{run_dir} is done: its last checkpoint is step {step_of(resume_from)} of --steps {cfg.steps}"
        say(f"nothing to do: {done} (a higher --steps trains on)", f"run dir: {run_dir}")
        dist.close()
        return {"run_dir": run_dir, "weights": last if last.is_dir() else None, "history": []}
    if is_main:
        write_provenance(run_dir, servers=[])

    # ------------------------------------------------------------ data (before the model: bad data fails fast)
    tokenizer = load_tokenizer(cfg.model.name)
    conversations = load_conversations(cfg.data)
    samples, truncated = tokenize_all(tokenizer, conversations, cfg.seq_len)
    per_rank = cfg.batch_size // world_size
    lengths = [len(ids) for ids, _ in samples]
    say(
        f"data {cfg.data.id}: {plural(len(conversations), 'conversation')}, {plural(len(samples), 'sample')}, "
        f"{sum(lengths) / len(lengths):.0f} tokens on average, {truncated} cut to seq_len {cfg.seq_len}",
        f"  {plural(cfg.batch_size // (cfg.micro_batch_size * world_size), 'micro-batch')} of "
        f"{cfg.micro_batch_size} per rank per step, packing {'on' if cfg.packing else 'off'}",
    )

    # ------------------------------------------------------------ dist and model
    torch.manual_seed(cfg.seed)  # LoRA's initialisation is random
    # float32 master weights (bf16 comes from autocast); saved in the dtype the model runs in (bf16 on CUDA).
    model, save_dtype, autocast = load_trainable(
        cfg.model,
        cfg.lora,
        device=device,
        world_size=world_size,
        packing=cfg.packing,
        activation_checkpointing=cfg.activation_checkpointing,
    )
    optimizer, scheduler = build_optimizer(model.parameters(), cfg.optim, cfg.steps)
    params = [p for p in model.parameters() if p.requires_grad]
    num_trained = sum(p.numel() for p in params)  # DTensors count their full size
    kind = f"LoRA rank {cfg.lora.rank}" if cfg.lora.rank else "full"
    say(
        f"model {cfg.model.name}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
        f"{num_trained / 1e6:.2f}M trained ({kind}), {world_size} x {device}"
    )

    # ------------------------------------------------------------ resume
    start = 0
    if cfg.resume and resume_from:
        start = load_checkpoint(resume_from, model, optimizer, scheduler)["step"]
        say(f"resumed from {resume_from} (step {start})")

    # ------------------------------------------------------------ loop
    log = RunLog(
        run_dir,
        total_steps=cfg.steps,
        start_step=start,
        enabled=is_main,
        print_every=cfg.log_every,
        wandb=cfg.wandb,
        config=to_dict(cfg),
    )
    history, weights = [], None
    stop = StopAfterStep()
    try:
        for step in range(start, cfg.steps):
            started = time.perf_counter()
            batch = [samples[i] for i in batch_indices(step, cfg.batch_size, len(samples), cfg.seed)]
            # Every rank knows the whole step's samples, so the normaliser needs no communication.
            loss_tokens = max(1, sum(sum(mask[1:]) for _, mask in batch))
            step_tokens = sum(len(ids) for ids, _ in batch)
            mine = batch[rank * per_rank : (rank + 1) * per_rank]
            loss_sum = 0.0
            for first in range(0, per_rank, cfg.micro_batch_size):
                rows = sft_rows(
                    mine[first : first + cfg.micro_batch_size],
                    cfg.seq_len,
                    cfg.packing,
                    tokenizer.pad_token_id,
                )
                input_ids, position_ids, loss_mask = (t.to(device) for t in rows)  # (R, L) each
                # The output layer scores the loss tokens in chunks (lib/trainer/head.py): no (R, L, vocabulary) logits.
                with autocast():
                    logp, _ = next_token_scores(model, input_ids, position_ids, loss_mask)  # (R, L)
                token_loss = -logp.sum()  # the cross-entropy of the assistant tokens
                # FSDP averages gradients over ranks; this loss is already a mean over all ranks' tokens.
                (token_loss * world_size / loss_tokens).backward()
                loss_sum += token_loss.item()
            grad_norm, lr = optimizer_step(optimizer, scheduler, cfg.optim.max_grad_norm)
            loss = dist.all_sum(loss_sum, device) / loss_tokens
            stopping = dist.all_sum(stop.requested, device) > 0  # a Ctrl-C on any rank stops them all here
            elapsed = time.perf_counter() - started

            # -------------------------------------------------------- log
            metrics = {
                "train/loss": loss,
                "train/lr": lr,
                "train/grad_norm": grad_norm,
                "perf/tokens_per_second": step_tokens / elapsed,
                "perf/step_seconds": elapsed,
            }
            history.append(metrics)
            log.scalars(step + 1, metrics)

            # -------------------------------------------------------- checkpoint
            done = step + 1
            if done % cfg.checkpoint_every == 0 or done == cfg.steps or stopping:
                log.flush()  # the curves on disk reach at least as far as the checkpoint
                weights = save_weights(run_dir, done, model, tokenizer, save_dtype, cfg.keep_checkpoints)
                progress = {"samples_seen": done * cfg.batch_size, "world_size": world_size}
                save_checkpoint(
                    run_dir,
                    done,
                    model,
                    optimizer=optimizer,
                    scheduler=scheduler,
                    progress=progress,
                    keep=cfg.keep_checkpoints,
                )
                say(f"saved {weights} and checkpoints/step_{done}")
                if is_main:
                    steps, losses = range(start + 1, done + 1), [m["train/loss"] for m in history]
                    plot_curve(
                        run_dir / rundir.LOSS_CURVE,
                        steps=list(steps),
                        values=losses,
                        label="loss (train)",
                        title=f"sft: {cfg.data.id}",
                    )
            if stopping and done < cfg.steps:
                raise KeyboardInterrupt  # run_main ends the run with the resume hint
    finally:
        stop.close()
        log.close()
    log.summary(history, "train/loss", weights, run_dir / rundir.LOSS_CURVE)
    dist.close()
    return {"run_dir": run_dir, "weights": weights, "history": history}


if __name__ == "__main__":
    config = parse(Config, description=__doc__)
    run_main(main, config, config.output_dir)
