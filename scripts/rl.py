"""The single controller: async GRPO-style RL against verifiers environments, with live weight sync.

Starts (or attaches to) inference servers, keeps groups of rollouts in flight, computes group-relative
advantages, trains with an importance-sampled policy loss (lib/trainer/loss.py, --loss.*), pushes new weights to
every server each step, logs to tensorboard (and wandb) and checkpoints for exact resume.

Where it departs from the textbook, on purpose:
1. Async: rollouts may come from weights up to max_async_level steps old; the importance ratio against
   the servers' own logprobs corrects for it (0 = on-policy).
2. One optimizer step per batch, and no recomputed "old" logprobs: the ratio is against the inference
   policy itself, so it also absorbs any trainer/server mismatch.
3. Default loss dppo (a probability-difference mask and a squared log-ratio pull), not PPO's clip
   (--loss.variant ppo, cispo, reinforce; GSPO's sequence ratio, mismatch correction: lib/trainer/loss.py).
4. Advantages are reward minus the group mean, not divided by the std (Dr. GRPO; --advantage.*: RLOO, std
   by group or step); flat groups train on nothing, and --filter-flat-groups replaces them with new draws.
5. The loss is a token mean over the whole step (all micro-batches and ranks); --loss.aggregation takes
   per-rollout means or Dr. GRPO's constant instead. Recipes by name: configs/recipes/ (grpo, dapo, ...).
6. No reference model, KL penalty or entropy bonus by default: --loss.kl-coef adds a KL (k1 or k3) to the
   starting weights (under LoRA the model with its adapter off), --loss.entropy-coef an entropy bonus.
7. With top_p < 1 or top_k > 0 each token's logprob is renormalised over the ids the server's filter kept
   (--kept-set: served by the engine, or recomputed by the trainer with vLLM's CPU rules); scored over the
   full vocabulary the ratio was biased (0.90 on-policy at top_p 0.9). top_p alone samples with top_k 512,
   a bound on the kept sets; a token outside its recomputed set is left out of the loss (train/outside_kept_set).
8. No dropout: LoRA's is refused, the model's switched off, so tokens score as the servers sampled them.
9. At max_async_level >= 1 the servers reload step N's weights while step N+1 trains (lib/inference/weights/sync.py
   Reloader); the logprob probe, which needs the trainer's live weights, runs at the start only.

With --teacher.model or --teacher.urls it distills on-policy from the teacher's per-token logprobs (docs/algorithms.md).
With --eval.every N, held-out tasks are evaluated as eval.py does (lib/orchestrator/evaluation.py); env.mix draws
several environments by ratio (lib/orchestrator/mixture.py). Runs write provenance.json, base.json and reward_curve.png too.

Usage:
    python scripts/rl.py @ configs/tiny/rl.toml                                     # CPU
    python scripts/rl.py @ configs/reverse_text/rl.toml                             # one GPU, shared
    python scripts/rl.py @ configs/reverse_text/rl.toml --inference.urls http://h:8000/v1
    python scripts/rl.py @ configs/reverse_text/rl.toml @ configs/recipes/gspo.toml  # a recipe
    python scripts/rl.py @ configs/smollm2_two_digit/distill.toml --teacher.model DIR # distillation
    torchrun --nproc-per-node 4 scripts/rl.py @ configs/alphabet_sort/rl.toml      # FSDP2 trainer
"""

import dataclasses
import sys
from pathlib import Path
from typing import Literal

sys.path.append(str(Path(__file__).resolve().parents[1]))  # finds lib/ outside the virtualenv too
import lib.venv  # noqa: F401  (first: says which python to use when the dependencies are missing)
from lib.config import StopAfterStep, UserError, parse, run_main
from lib.inference.launch import InferenceConfig
from lib.log import WandbConfig
from lib.models.load import ModelConfig
from lib.orchestrator.envs import EnvConfig
from lib.orchestrator.evaluation import EvalConfig
from lib.orchestrator.rollouts import AdvantageConfig
from lib.orchestrator.teacher import TeacherConfig, check_teacher
from lib.sampling import SamplingConfig
from lib.trainer.loss import DistillConfig, LossConfig
from lib.trainer.optim import OptimConfig
from lib.trainer.trainable import LoraConfig


@dataclasses.dataclass
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The policy to train (usually an SFT run's weights/step_N)."""
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    """The environment (env.mix: more of them, drawn by ratio; lib/orchestrator/mixture.py)."""
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    """Rollout sampling."""
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    """Policy loss."""
    advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
    """Advantages: the baseline and the std normalisation (lib/orchestrator/rollouts.py)."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """AdamW and schedule."""
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    """LoRA (rank 0 = full); servers get the adapter alone, or merged weights (inference.lora_sync)."""
    inference: InferenceConfig = dataclasses.field(default_factory=InferenceConfig)
    """Inference servers."""
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Evaluation on held-out tasks during the run (off unless eval.every > 0)."""
    teacher: TeacherConfig = dataclasses.field(default_factory=TeacherConfig)
    """On-policy distillation: the teacher that scores every rollout's tokens (off unless teacher.model or urls)."""
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
    """On-policy distillation's loss: the reward's weight beside the teacher's per-token advantage."""
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    """Weights & Biases logging beside tensorboard (off unless wandb.project is set)."""
    steps: int = 20
    """Optimizer steps."""
    examples_per_step: int = 8
    """Prompts per step; each gets rollouts_per_example episodes."""
    rollouts_per_example: int = 16
    """Group size for the group-relative advantage."""
    # 8 x 4096 = 32k tokens a forward. The output layer runs in 1024-token chunks (lib/trainer/head.py: ~2 GB at
    # Qwen's 151,936-row vocabulary whatever the rows, + a float32 (V, H) gradient buffer when it trains:
    # 0.58 GiB at hidden 1024, 1.45 GiB at 2560, none under LoRA; full float32 logits were ~4 x 0.6 GB per
    # 1k tokens, ~80 GB here), so activations bound it: ~1 MB a token at Qwen3-0.6B in bf16, 31 GB (the 4B
    # preset takes 2).
    micro_batch_size: int = 8
    """Packed rows per forward/backward on one rank."""
    seq_len: int = 4096
    """Tokens per packed training row (the longest episode must fit)."""
    activation_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    packing: bool = True
    """Pack several rollouts per row of seq_len; off = one padded row per rollout, which is faster for
    short rollouts of similar length on CPU (one attention call per micro-batch, not one per rollout)."""
    share_prompts: Literal["auto", "on", "off"] = "auto"
    """Hold each group's prompt once in its packed row, its rollouts as branches attending to it and to
    themselves (lib/trainer/packing.py shared_prompts): the same logprobs and gradients from fewer tokens. Needs
    packing and sdpa. auto: on on a CPU; on CUDA rows with branches leave the variable-length kernel for
    the per-sample loop, so it is on only when asked."""
    max_async_level: int = 1
    """Rollouts may come from a policy at most this many steps old (0 = fully on-policy)."""
    kept_set: Literal["auto", "served", "recomputed"] = "auto"
    """With top_p < 1 or top_k > 0, how the trainer knows each sampled token's kept set (the ids top-k/top-p
    left), which its logprob is renormalised over. served: the server returns them (--return-sampling-mask: the
    builtin engine, vLLM on GPUs); recomputed: the trainer rebuilds them from its own logits with vLLM's CPU
    rules (any server; exact against vLLM's CPU build, approximate against GPU vLLM's kernel); auto: served
    when rl.py starts a server that can, else recomputed."""
    filter_flat_groups: bool = False
    """Replace each group whose rewards are all equal by a new one (bounded per step, rollouts/resampled):
    steps train on groups with signal, at the cost of the replaced groups' sampling time (lib/orchestrator/producer.py)."""
    output_dir: Path = Path("outputs/rl")
    """Run directory: config.toml, tb/, weights/, checkpoints/, rollouts/."""
    checkpoint_every: int = 10
    """Resumable checkpoint every N steps (and at the end)."""
    save_merged: bool = False
    """LoRA adapter sync: write the merged model to weights/step_N/merged every step, not only the last."""
    keep_weights: int = 3
    """weights/step_N directories kept (at least 2: the servers may still read the previous one)."""
    keep_checkpoints: int = 2
    """Resumable checkpoints kept."""
    sample_every: int = 5
    """Show a sample completion on the console and in tensorboard every N steps."""
    resume: bool = False
    """Continue from the newest complete checkpoint in output_dir (step 0 if there is none yet), with the
    run's own config: `@` presets are ignored, flags change it (recorded in resumes.jsonl)."""
    seed: int = 0
    """Seed of data order and initialisation-time randomness."""
    peer_timeout: float = 120.0
    """Several processes: a rank ends when a peer sends no heartbeat for this many seconds (a node
    killed, frozen or cut off); waiting on a busy rank 0 (rollouts, starting servers) never counts."""

    def __post_init__(self):
        if min(self.steps, self.examples_per_step, self.rollouts_per_example, self.micro_batch_size) < 1:
            raise UserError(
                "steps, examples_per_step, rollouts_per_example and micro_batch_size must be >= 1."
            )
        if self.rollouts_per_example < 2:
            raise UserError("rollouts_per_example must be at least 2: a group of one has no advantage.")
        if self.max_async_level < 0:
            raise UserError("max_async_level must be >= 0.")
        if self.lora.dropout > 0:
            raise UserError(
                "rl.py trains with lora.dropout = 0 only: dropout would score other weights than the servers "
                "sample with, which biases the importance ratio (sft.py takes dropout)."
            )
        if self.sampling.temperature == 0:
            raise UserError(
                "rl.py samples with sampling.temperature > 0 only: greedy decoding has no distribution for "
                "the importance ratio to correct."
            )
        if self.keep_weights < 2 or self.keep_checkpoints < 1 or self.checkpoint_every < 1:
            raise UserError("keep_weights must be >= 2, keep_checkpoints and checkpoint_every >= 1.")
        if self.peer_timeout <= 0:
            raise UserError("peer_timeout must be a positive number of seconds.")
        if self.share_prompts == "on" and not (self.packing and self.model.attn_implementation == "sdpa"):
            raise UserError(
                "share_prompts on needs packing and model.attn_implementation sdpa (lib/trainer/packing.py)."
            )


def main(cfg: Config) -> dict:
    """Trains and returns {"run_dir", "weights" (the last weights/step_N), "history" (metrics per step)}."""
    import contextlib
    import time

    import torch

    from lib import dist, rundir
    from lib.config import to_dict
    from lib.inference import launch
    from lib.inference.weights import sync
    from lib.log import RunLog, rl_line, say
    from lib.models.load import check_model_name, load_tokenizer, resolve_device
    from lib.orchestrator.producer import start_producer
    from lib.orchestrator.tasks import check_env_ids
    from lib.plot import eval_points
    from lib.trainer.checkpoint import open_run, resume_rl, save_checkpoint, step_of
    from lib.trainer.loss import loss_function
    from lib.trainer.optim import build_optimizer
    from lib.trainer.packing import pack_step
    from lib.trainer.servable import servable
    from lib.trainer.train import train_step
    from lib.trainer.trainable import load_policy

    # ------------------------------------------------------------ config and run directory
    rank, _, world_size = dist.world()
    is_main = rank == 0
    check_model_name(cfg.model.name)
    check_env_ids(cfg.env, examples_per_step=cfg.examples_per_step)  # before any run directory or server
    check_teacher(cfg)  # a reward weight without a teacher, or a teacher's other tokens: before any server
    # LoRA: the adapter's name on the servers, None where they load the merged model.
    adapter = launch.ADAPTER_NAME if cfg.lora.rank and cfg.inference.lora_sync == "adapter" else None
    cfg.inference.weight_sync = sync.weight_sync_mode(cfg, resolve_device(cfg.model), bool(adapter))
    run_dir = cfg.output_dir
    # Every rank joins first: rank 0 alone claims the run directory, the others take its answer (open_run).
    device = dist.init(resolve_device(cfg.model), cfg.peer_timeout)
    resume_from = open_run(cfg, say)
    if resume_from and step_of(resume_from) >= cfg.steps:  # before any server or model starts
        last = servable(run_dir / rundir.WEIGHTS / resume_from.name)
        done = f"{run_dir} is done: its last checkpoint is step {step_of(resume_from)} of --steps {cfg.steps}"
        say(f"nothing to do: {done} (a higher --steps trains on)", f"run dir: {run_dir}")
        dist.close()
        return {"run_dir": run_dir, "weights": last if last.is_dir() else None, "history": []}

    # ------------------------------------------------------------ model, optimizer, loss
    torch.manual_seed(cfg.seed)
    model, save_dtype, autocast, reference = load_policy(cfg, device, world_size)
    tokenizer = load_tokenizer(cfg.model.name)
    optimizer, scheduler = build_optimizer(model.parameters(), cfg.optim, cfg.steps)
    compute_loss = loss_function(cfg.loss)  # lib/trainer/loss.py's, or the one loss.import_path names
    # Inference logprobs are of the tempered distribution, the one sampled from, over each sampled token's
    # kept set when top-k/top-p filter it (lib/trainer/head.py KeptSets).
    kept_set = launch.kept_set_mode(cfg, device)
    progress = resume_rl(resume_from if cfg.resume else None, model, optimizer, scheduler, say=say)
    start = progress.get("step", 0)

    with contextlib.ExitStack() as cleanup:
        # -------------------------------------------------------- inference servers, environments, producer
        # Every rank knows whether the adapter alone is written (a collective); rank 0 adds the servers.
        servers, evaluator = sync.Servers(urls=[], names=[], adapter=adapter), None
        if is_main:
            servers = sync.open_servers(
                cfg, model, save_dtype=save_dtype, autocast=autocast, device=device, kept_set=kept_set,
                adapter=adapter, cleanup=cleanup, say=say,
            )  # fmt: skip
        # At max_async_level >= 1 the servers reload beside the next step's training (sync.Reloader);
        # on-policy, the next step needs this step's weights anyway.
        weight_sync = sync.WeightSync(
            run_dir, model, servers, background=cfg.max_async_level >= 1, last_step=cfg.steps,
            tokenizer=tokenizer, save_dtype=save_dtype, autocast=autocast,
            keep_weights=cfg.keep_weights, save_merged=cfg.save_merged,
            memory=cfg.inference.weight_sync == "memory", write_every=cfg.checkpoint_every,
        )  # fmt: skip
        # Every server, started or attached, loads the run's starting weights and is checked against the
        # trainer before any training: an attached one may hold another run's weights, and a server that
        # cannot read the run directory, or runs another model or dtype, stops the run here.
        weight_sync.publish(start, "at the start of the run")
        # Before the producer's thread: wandb's import runs ast.parse, which Python 3.11 fails beside another's.
        log = RunLog(
            run_dir, total_steps=cfg.steps, start_step=start, enabled=is_main, print_every=1, wandb=cfg.wandb,
            config=to_dict(cfg), line=rl_line,
        )  # fmt: skip
        cleanup.callback(log.close)
        if is_main:
            mixture, evaluator, producer = start_producer(
                cfg, servers, run_dir=run_dir, progress=progress, start=start, served_kept_sets=kept_set == "served",
                teacher=launch.open_teacher(cfg, api_key=servers.api_key, device=device, cleanup=cleanup, say=say),
            )  # fmt: skip
            cleanup.callback(producer.stop)
            say(f"{mixture.describe()}; {len(servers.urls)} server(s): {' '.join(servers.urls)}")
            weight_sync.attach(on_loaded=producer.set_version)
            cleanup.callback(weight_sync.close)  # a reload in flight finishes, before the producer stops
        history, weights, flat_steps = [], None, 0
        if evaluator is not None:
            log.evaluation(start, evaluator(start))
        stop = StopAfterStep()
        cleanup.callback(stop.close)
        for step in range(start, cfg.steps):
            step_number = step + 1
            step_began = time.perf_counter()
            # ---------------------------------------------------- batch: rank 0 takes and packs the step's groups
            batch, rollouts, micro_batches_per_rank = None, [], [None] * world_size
            if is_main:
                batch = producer.take(
                    step,
                    report=lambda message: say(f"rollout error: {message}"),
                    check=weight_sync.check_servers,
                )
                rollouts, micro_batches_per_rank = pack_step(
                    cfg, batch, world_size, tokenizer, kept_set, device
                )
            wait_seconds = time.perf_counter() - step_began
            rank_micro_batches, counts = dist.scatter(micro_batches_per_rank)

            # ---------------------------------------------------- train
            train_began = time.perf_counter()
            totals, lr = train_step(
                model, optimizer, scheduler, rank_micro_batches, counts, cfg=cfg, compute_loss=compute_loss,
                kept_set=kept_set, reference=reference, autocast=autocast, world_size=world_size, device=device,
                distill=cfg.distill if cfg.teacher.enabled else None,
            )  # fmt: skip
            train_seconds = time.perf_counter() - train_began

            # ---------------------------------------------------- weight sync and evaluation
            sync_metrics = weight_sync.after_step(step_number)
            weights = servable(run_dir / "weights" / f"step_{step_number}")
            # The loop waits for the eval, after the reload: the servers hold this step's weights.
            if evaluator is not None and (step_number % cfg.eval.every == 0 or step_number == cfg.steps):
                weight_sync.wait()
                log.evaluation(step_number, evaluator(step_number))

            # ---------------------------------------------------- log
            if is_main:
                seconds = {"time/wait_rollouts": wait_seconds, "time/train": train_seconds, **sync_metrics}
                metrics = step_metrics(cfg, batch, rollouts, totals, counts, lr, seconds, step_began, mixture)
                history.append(metrics)
                flat_steps += report(cfg, log, step_number, batch, metrics, history)

            # ---------------------------------------------------- checkpoint
            stopping = dist.all_sum(stop.requested, device) > 0  # a Ctrl-C on any rank stops them all here
            if step_number % cfg.checkpoint_every == 0 or step_number == cfg.steps or stopping:
                weight_sync.wait()  # a checkpoint (a Ctrl-C's, the last) leaves the servers on its weights
                log.flush()  # the curves on disk reach at least as far as the checkpoint
                progress = {"world_size": world_size, **(mixture.state() if is_main else {})}
                save_checkpoint(
                    run_dir, step_number, model, optimizer=optimizer, scheduler=scheduler, progress=progress,
                    keep=cfg.keep_checkpoints,
                )  # fmt: skip
                if is_main:
                    plot(cfg, history, start, eval_points(evaluator))
            if stopping and step_number < cfg.steps:
                say(f"stopped after step {step_number}: checkpoints/step_{step_number} saved")
                raise KeyboardInterrupt  # run_main ends the run with the resume hint
    if history and flat_steps == len(history):
        say(
            "WARNING: no learning signal in any step: every group was flat. Warm the model up with SFT first."
        )
    log.summary(history, "reward/mean", weights, run_dir / rundir.REWARD_CURVE, eval_points(evaluator))
    dist.close()
    return {"run_dir": run_dir, "weights": weights, "history": history}


# ---------------------------------------------------------------- the loop's steps, rank 0
def step_metrics(
    cfg: Config, batch, rollouts, totals, counts, lr, seconds: dict, began: float, mixture
) -> dict:
    """The step's metrics (docs/metrics.md): rollouts, training sums, rates and where the time went."""
    import time

    num_tokens = sum(len(r.token_ids) for r in rollouts)
    metrics = {
        **batch.metrics(cfg.env.id, tuple(source.name for source in mixture.sources)),
        # The loss's sums under train/, but distill/reverse_kl, named in full where it is summed.
        **{name if "/" in name else f"train/{name}": value for name, value in totals.items()},
        "train/lr": lr,
        "train/rollouts": counts["num_rollouts"],
        "train/episodes": counts["num_episodes"],
        "perf/tokens_per_second": num_tokens / max(seconds["time/train"], 1e-9),
        # The engines' generation rate as the loop sees it: over the step's wall time.
        "perf/rollout_tokens_per_second": batch.sampled_tokens / max(time.perf_counter() - began, 1e-9),
        **seconds,
        "time/step": time.perf_counter() - began,
    }
    if cfg.loss.mask_truncated:
        metrics["train/truncated_masked"] = len(batch.rollouts) - len(rollouts)
    return metrics


def report(cfg: Config, log, step_number: int, batch, metrics: dict, history: list) -> bool:
    """The step's scalars, warnings, sample and rollout records; whether every group was flat."""
    from lib import rundir
    from lib.log import say
    from lib.orchestrator.rollouts import write_records

    log.scalars(step_number, metrics)
    if step_errors := int(metrics["rollouts/errors"]):
        in_run = sum(int(m["rollouts/errors"]) for m in history)
        say(f"step {step_number}: {step_errors} rollout errors ({in_run} in the run)")
    flat = batch.num_flat_groups == len(batch.groups) and not cfg.teacher.enabled  # a teacher's is per token
    if flat:
        say(
            f"WARNING step {step_number}: every group is flat (all rewards equal): no learning "
            "signal. Warm the model up with SFT, raise the temperature or change the task difficulty."
        )
    if step_number % cfg.sample_every == 0 or step_number == cfg.steps:
        sample = max(batch.groups[0], key=lambda r: r.reward)
        log.sample(step_number, sample.messages, sample.reward)
    write_records(cfg.output_dir / rundir.ROLLOUTS / f"step_{step_number}.jsonl", batch.groups)
    return flat


def plot(cfg: Config, history: list, start: int, points) -> None:
    """reward_curve.png: the steps' mean reward, with the evaluations' points."""
    from lib import rundir
    from lib.plot import plot_curve

    plot_curve(
        cfg.output_dir / rundir.REWARD_CURVE, steps=list(range(start + 1, start + 1 + len(history))),
        values=[m["reward/mean"] for m in history], label="reward (mean of the step's rollouts)",
        title=f"rl: {cfg.env.id}", points=points,
    )  # fmt: skip


if __name__ == "__main__":
    config = parse(Config, description=__doc__)
    run_main(main, config, config.output_dir)
