"""The single controller: async GRPO-style RL against verifiers environments, with live weight sync.

Starts (or attaches to) inference servers, keeps groups of rollouts in flight, computes
group-relative advantages, trains with an importance-sampled policy loss, pushes new weights to every
server each step, logs to tensorboard (and wandb with --wandb.project) and checkpoints for exact resume.
The loss variants and their papers are described in lib/loss.py (options: --loss.*). Sampling takes
temperature only: top_p and top_k are refused, since the trainer cannot reproduce the server's
truncation exactly and the importance ratio would be biased (measured on-policy: 0.90 at top_p 0.9).

--eval.every N holds out the taskset's last eval.num_examples tasks and evaluates them as eval.py does
(sampled, pass@k, greedy) at the start, every N steps and at the end. The loop waits for each eval, so
it scores exactly step N's weights (the next publish comes after it) while the producer keeps sampling
beside it; its cost is logged as eval/seconds. Runs write provenance.json and reward_curve.png too.
Several environments (env.mix) are drawn by ratio, with metrics and evaluations per environment
(lib/mixture.py); --filter-flat-groups replaces groups whose rewards are all equal (lib/rollouts.py).

Usage:
    python scripts/rl.py @ configs/tiny/rl.toml                                     # CPU
    python scripts/rl.py @ configs/reverse_text/rl.toml                             # one GPU, shared
    python scripts/rl.py @ configs/reverse_text/rl.toml --inference.urls http://h:8000/v1
    torchrun --nproc-per-node 4 scripts/rl.py @ configs/alphabet_sort/rl.toml      # FSDP2 trainer
"""

import dataclasses
from pathlib import Path

from lib.config import StopAfterStep, UserError, given_api_key, parse, run_main
from lib.envs import EnvConfig
from lib.evaluation import EvalConfig
from lib.inference import InferenceConfig
from lib.log import WandbConfig
from lib.loss import LossConfig
from lib.model import LoraConfig, ModelConfig
from lib.optim import OptimConfig
from lib.sampling import SamplingConfig


@dataclasses.dataclass
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The policy to train (usually an SFT run's weights/step_N)."""
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    """The environment (env.mix: more of them, drawn by ratio; lib/mixture.py)."""
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    """Rollout sampling."""
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    """Policy loss."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """AdamW and schedule."""
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    """LoRA (rank 0 = full); servers get the adapter alone, or merged weights (inference.lora_sync)."""
    inference: InferenceConfig = dataclasses.field(default_factory=InferenceConfig)
    """Inference servers."""
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Evaluation on held-out tasks during the run (off unless eval.every > 0)."""
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    """Weights & Biases logging beside tensorboard (off unless wandb.project is set)."""
    steps: int = 20
    """Optimizer steps."""
    examples_per_step: int = 8
    """Prompts per step; each gets rollouts_per_example episodes."""
    rollouts_per_example: int = 16
    """Group size for the group-relative advantage."""
    # 8 x 4096 = 32k tokens a forward. The output layer runs in 1024-token chunks (lib/head.py: ~2 GB at
    # Qwen's 151,936-row vocabulary whatever the rows; full float32 logits were ~4 x 0.6 GB per 1k tokens,
    # ~80 GB here), so activations bound it: ~1 MB a token at Qwen3-0.6B in bf16, 31 GB (the 4B preset takes 2).
    micro_batch_size: int = 8
    """Packed rows per forward/backward on one rank."""
    seq_len: int = 4096
    """Tokens per packed training row (the longest episode must fit)."""
    activation_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    packing: bool = True
    """Pack several rollouts per row of seq_len; off = one padded row per rollout, which is faster for
    short rollouts of similar length on CPU (one attention call per micro-batch, not one per rollout)."""
    max_async_level: int = 1
    """Rollouts may come from a policy at most this many steps old (0 = fully on-policy)."""
    normalize_advantage: bool = False
    """Divide advantages by the group's reward std."""
    filter_flat_groups: bool = False
    """Replace each group whose rewards are all equal by a new one (bounded per step, rollouts/resampled):
    steps train on groups with signal, at the cost of the replaced groups' sampling time (lib/rollouts.py)."""
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
    """Log sample completions to tensorboard every N steps."""
    resume: bool = False
    """Continue from the newest complete checkpoint in output_dir."""
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
        if self.sampling.top_p < 1 or self.sampling.top_k > 0:
            raise UserError(
                "rl.py trains with sampling.top_p = 1 and sampling.top_k = -1 only: top_p and top_k truncate "
                "the sampled distribution at a boundary the trainer cannot reproduce exactly, which biases "
                "the importance ratio (use temperature to shape sampling)."
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


def main(cfg: Config) -> dict:
    """Trains and returns {"run_dir", "weights" (the last weights/step_N), "history" (metrics per step)}."""
    import contextlib
    import time

    import torch

    from lib import dist, envs, inference, sync
    from lib.checkpoint import drop_newer, load_checkpoint, open_run, save_checkpoint, save_weights, servable
    from lib.config import to_dict
    from lib.head import next_token_scores
    from lib.log import RunLog
    from lib.loss import policy_loss, token_share
    from lib.mixture import env_metrics, load_mixture
    from lib.model import check_model_name, load_tokenizer, load_trainable, resolve_device
    from lib.optim import build_optimizer, optimizer_step
    from lib.packing import rl_micro_batches
    from lib.plot import eval_points, plot_curve
    from lib.rollouts import Producer, write_records

    # ------------------------------------------------------------ config and run directory
    rank, _, world_size = dist.world()
    is_main = rank == 0
    log_main = print if is_main else (lambda *args: None)
    check_model_name(cfg.model.name)
    run_dir = cfg.output_dir
    resume_from = open_run(cfg, is_main, log_main)

    # ------------------------------------------------------------ dist and model
    device = dist.init(resolve_device(cfg.model), cfg.peer_timeout)
    torch.manual_seed(cfg.seed)
    model, save_dtype, autocast = load_trainable(
        cfg.model, cfg.lora, device, world_size, cfg.packing, cfg.activation_checkpointing
    )
    tokenizer = load_tokenizer(cfg.model.name)
    optimizer, scheduler = build_optimizer(model.parameters(), cfg.optim, cfg.steps)
    # Inference logprobs are of the tempered distribution, the one sampled from.
    temperature = cfg.sampling.temperature
    # LoRA: the adapter's name on the servers, None where they load the merged model.
    adapter = inference.ADAPTER_NAME if cfg.lora.rank and cfg.inference.lora_sync == "adapter" else None

    start, progress = 0, {}
    if cfg.resume and resume_from:
        # Its draw counters count the tasks started before it, in flight ones included: skipped, not replayed.
        progress = load_checkpoint(resume_from, model, optimizer, scheduler)
        start = progress["step"]
        log_main(f"resumed from {resume_from} (step {start})")
        if is_main:
            drop_newer(run_dir / "weights", start)

    with contextlib.ExitStack() as cleanup:
        # -------------------------------------------------------- inference servers and environment (rank 0)
        urls, names, api_key, evaluator = [], [], None, None
        if is_main:
            api_key = given_api_key(cfg.inference.api_key)
            urls, names, _ = inference.start_or_attach(
                cfg.inference,
                cfg.model,
                str(save_dtype).removeprefix("torch."),
                getattr(model.config, "max_position_embeddings", cfg.seq_len),
                cfg.seq_len,
                device,
                cfg.max_async_level == 0,
                run_dir,
                api_key,
                cleanup,
                log_main,
                cfg.lora.rank if adapter else 0,
            )
            # The prompts are rendered here, as for any run, with model.name's tokenizer and renderer.
            renderer = envs.renderer_name(cfg.model.name)
            contexts = [
                envs.model_context(url, name, cfg.sampling, api_key, True, cfg.model.name, renderer)
                for url, name in zip(urls, names)
            ]
            mixture, evaluator = load_mixture(cfg, urls[0], names[0], api_key, run_dir / "eval", progress)
            log_main(f"{mixture.describe()}; {len(urls)} server(s): {' '.join(urls)}")

        # -------------------------------------------------------- weight sync
        probe_prompt = tokenizer.encode(sync.PROBE_TEXT, add_special_tokens=False)
        bf16_tolerance = sync.BF16_PROBE_TOLERANCE
        tolerance = cfg.inference.probe_tolerance or (1e-3 if save_dtype == torch.float32 else bf16_tolerance)

        def publish(version: int, when: str) -> tuple[float, float]:
            """Writes weights/step_N, has every server load it and checks that each serves it (lib/sync.py);
            returns the seconds it took and the largest mean |logprob difference| from the trainer."""
            began = time.perf_counter()
            merged, keep = cfg.save_merged or version == cfg.steps, cfg.keep_weights
            path = save_weights(run_dir, version, model, tokenizer, save_dtype, keep, bool(adapter), merged)
            label, probes = f"step_{version}", []
            if is_main:
                sync.reload_weights(urls, path, api_key, label, cfg.inference.pause_mode, adapter)
                probes = [sync.probe(url, name, probe_prompt, api_key) for url, name in zip(urls, names)]
            probes = dist.scatter([probes] * world_size)  # every rank takes part in the trainer's forward
            differences = []
            for probe in probes:
                trainer_logprobs = sync.trainer_logprobs(model, autocast, probe_prompt, probe.completion_ids)
                if is_main:
                    differences.append(sync.compare(probe, trainer_logprobs, label, tolerance, when))
            return time.perf_counter() - began, max(differences, default=0.0)

        # Every server, started or attached, loads the run's starting weights from the run directory and
        # is checked against the trainer before any training: an attached one may hold another run's
        # weights (step 1 would be off-policy), and a server that cannot read the run directory, or runs
        # another model or dtype, stops the run here rather than after a step.
        publish(start, "at the start of the run")

        # -------------------------------------------------------- rollout producer (rank 0)
        if is_main:
            producer = Producer(
                mixture,
                contexts,
                cfg.rollouts_per_example,
                cfg.examples_per_step,
                cfg.max_async_level,
                cfg.inference.max_concurrent,
                cfg.normalize_advantage,
                start_version=start,
                seq_len=cfg.seq_len,
                filter_flat_groups=cfg.filter_flat_groups,
            )
            producer.start()
            cleanup.callback(producer.stop)
        log = RunLog(run_dir, cfg.steps, start, is_main, 1, cfg.wandb, to_dict(cfg))
        cleanup.callback(log.close)
        history, weights, flat_steps, num_errors, env_errors = [], None, 0, 0, {}

        def plot() -> None:
            steps, rewards = range(start + 1, start + 1 + len(history)), [m["reward/mean"] for m in history]
            label, title = "reward (mean of the step's rollouts)", f"rl: {cfg.env.id}"
            plot_curve(
                run_dir / "reward_curve.png", list(steps), rewards, label, title, eval_points(evaluator)
            )

        if evaluator is not None:
            log.evaluation(start, evaluator(start))
        stop = StopAfterStep()
        cleanup.callback(stop.close)
        for step in range(start, cfg.steps):
            step_number = step + 1
            began = time.perf_counter()
            # ---------------------------------------------------- batch: rank 0 takes the step's groups
            micro_batches_per_rank = [None] * world_size
            if is_main:
                batch = producer.take(
                    step,
                    report=lambda message: log.print(f"rollout error: {message}"),
                    check=lambda: inference.check_servers(urls, api_key),
                )
                if batch.num_too_long:
                    log.print(
                        f"WARNING step {step_number}: dropped {batch.num_too_long} rollouts (whole groups) longer "
                        f"than seq_len {cfg.seq_len} (rollouts/too_long)"
                    )

                # ------------------------------------------------ pack and split over the ranks
                micro_batches = rl_micro_batches(
                    batch.rollouts,
                    cfg.seq_len,
                    cfg.micro_batch_size,
                    tokenizer.pad_token_id,
                    num_micro_batches_multiple=world_size,
                    packing=cfg.packing,
                )
                num_loss_tokens = sum(mb.num_loss_tokens() for mb in micro_batches)
                micro_batches_per_rank = [
                    (micro_batches[r::world_size], num_loss_tokens) for r in range(world_size)
                ]
            waited = time.perf_counter() - began
            rank_micro_batches, num_loss_tokens = dist.scatter(micro_batches_per_rank)

            # ---------------------------------------------------- train
            trained_at = time.perf_counter()
            sums = {"loss": 0.0, "entropy": 0.0}
            for mb in rank_micro_batches if num_loss_tokens else []:
                mb = mb.to(device)
                with autocast():  # (R, T) each: no logits over the vocabulary (lib/head.py)
                    logp, token_entropy = next_token_scores(
                        model, mb.input_ids, mb.position_ids, mb.loss_mask, temperature
                    )
                loss, metrics = policy_loss(
                    logp, mb.inference_logp, mb.advantages, mb.loss_mask, num_loss_tokens, cfg.loss
                )
                # FSDP averages gradients over ranks; the loss is already this rank's share of the mean.
                (loss * world_size).backward()
                sums["loss"] += loss.item()
                sums["entropy"] += token_share(token_entropy, mb.loss_mask, num_loss_tokens).item()
                for name, value in metrics.items():
                    sums[name] = sums.get(name, 0.0) + value.item()
            grad_norm, lr = optimizer_step(optimizer, scheduler, cfg.optim.max_grad_norm)
            if num_loss_tokens:
                sums["grad_norm"] = grad_norm / world_size  # every rank has the full norm; summed below
            totals = {name: dist.all_sum(value, device) for name, value in sorted(sums.items())}
            trained = time.perf_counter() - trained_at

            # ---------------------------------------------------- weight sync and evaluation
            synced, probe_difference = publish(step_number, f"after step {step_number}")
            weights = servable(run_dir / "weights" / f"step_{step_number}")
            if is_main:
                producer.set_version(step_number)
            # The loop waits for the eval: the servers hold this step's weights until the next publish.
            if evaluator is not None and (step_number % cfg.eval.every == 0 or step_number == cfg.steps):
                log.evaluation(step_number, evaluator(step_number))

            # ---------------------------------------------------- log
            if is_main:
                num_tokens = sum(len(r.token_ids) for r in batch.rollouts)
                metrics = {
                    **batch.metrics(cfg.env.id),
                    **env_metrics(batch.groups, producer.errors_by_env, env_errors, mixture.sources),
                    **{f"train/{k}": v for k, v in totals.items()},
                    "train/lr": lr,
                    "rollouts/errors": producer.num_errors - num_errors,
                    "perf/tokens_per_second": num_tokens / max(trained, 1e-9),
                    "time/wait_rollouts": waited,
                    "time/train": trained,
                    "time/sync_weights": synced,
                    "sync/probe_logprob_difference": probe_difference,
                    "time/step": time.perf_counter() - began,
                }
                history.append(metrics)
                log.scalars(step_number, metrics)
                if producer.num_errors > num_errors:
                    log.print(
                        f"step {step_number}: {producer.num_errors - num_errors} rollout errors "
                        f"({producer.num_errors} in the run)"
                    )
                num_errors, env_errors = producer.num_errors, dict(producer.errors_by_env)
                if batch.num_flat_groups == len(batch.groups):
                    flat_steps += 1
                    log.print(
                        f"WARNING step {step_number}: every group is flat (all rewards equal): no learning "
                        "signal. Warm the model up with SFT, raise the temperature or change the task difficulty."
                    )
                if step_number % cfg.sample_every == 0 or step_number == cfg.steps:
                    sample = max(batch.groups[0], key=lambda r: r.reward)
                    text = f"reward {sample.reward:.3f}\n\n```\n{sample.completion}\n```"
                    log.text(step_number, "samples", text)
                write_records(run_dir / "rollouts" / f"step_{step_number}.jsonl", batch.groups)

            # ---------------------------------------------------- checkpoint
            stopping = dist.all_sum(stop.requested, device) > 0  # a Ctrl-C on any rank stops them all here
            if step_number % cfg.checkpoint_every == 0 or step_number == cfg.steps or stopping:
                log.flush()  # the curves on disk reach at least as far as the checkpoint
                progress = {"world_size": world_size, **(mixture.state() if is_main else {})}
                save_checkpoint(
                    run_dir, step_number, model, optimizer, scheduler, progress, cfg.keep_checkpoints
                )
                if is_main:
                    plot()
            if stopping and step_number < cfg.steps:
                log.print(f"stopped after step {step_number}: checkpoints/step_{step_number} saved")
                raise KeyboardInterrupt  # run_main ends the run with the resume hint
    if history and flat_steps == len(history):
        log_main(
            "WARNING: no learning signal in any step: every group was flat. Warm the model up with SFT first."
        )
    log_main(f"run dir: {run_dir}")
    dist.close()
    return {"run_dir": run_dir, "weights": weights, "history": history}


if __name__ == "__main__":
    config = parse(Config, description=__doc__)
    run_main(main, config, config.output_dir)
