"""Weight sync: each step's weights written and loaded by every server (lib/inference/weights/reload.py), or broadcast into their
memory (lib/inference/weights/transfer.py), then checked with the probe (lib/inference/weights/probing.py), on-policy before the next rollouts or
beside the next step's training."""

import concurrent.futures
import dataclasses
import math
import time
from pathlib import Path

from lib import dist, endpoint
from lib.config import UserError
from lib.inference.weights import probing, reload, transfer
from lib.trainer.servable import save_weights


@dataclasses.dataclass
class Servers:
    """The inference servers a run keeps in sync with its trainer. Rank 0 knows them; the other ranks hold
    an instance with no URLs and take part only in the trainer's side of the check."""

    urls: list[str]
    """Base URLs (http://host:port/v1)."""
    names: list[str]
    """The model name each server answers to."""
    api_key: str | None = None
    """Bearer key of every server."""
    pause_mode: str = "wait"
    """How a reload pauses a server: inference.pause_mode."""
    adapter: str | None = None
    """LoRA adapter sync: the adapter's name on the servers; None where they load full weights."""
    probe_tolerance: float = 1e-3
    """Largest mean |logprob difference| between a server and the trainer on the probe tokens."""
    top_k: int = -1
    """The run's sampling.top_k, bounded (lib/sampling.py bounded): the probe samples with it too."""
    top_p: float = 1.0
    """The run's sampling.top_p."""
    kept_set: str = "none"
    """How the trainer knows each sampled token's kept set: served, recomputed, or none (no top-k/top-p)."""
    sender: transfer.Sender | None = None
    """In-memory sync (inference.weight_sync memory): the group with the servers; None = from the disk."""

    def reload(self, weights: Path | dict, label: str) -> None:
        """Every server takes `weights` under `label`, paused by this run's pause_mode: a directory it loads
        (reload_weights), or {name: tensor} broadcast into its memory (transfer.update_in_memory)."""
        if isinstance(weights, dict):
            tied = "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights
            transfer.update_in_memory(self.sender, weights, tied, label, self.pause_mode)
            return
        reload.reload_weights(
            self.urls, weights, self.api_key, label, pause_mode=self.pause_mode, adapter=self.adapter
        )


def open_servers(
    cfg, model, *, save_dtype, autocast, device: str, kept_set: str, adapter: str | None, cleanup, say
) -> Servers:
    """rl.py's servers (rank 0) for its config `cfg`: attached to inference.urls, or one started on
    model.name (`cleanup` stops it), each request's key in this process's environment, the probe's
    tolerance set by the trainer's dtype, and, for an in-memory sync, the sender that forms the group.
    `adapter`: the LoRA adapter's name on the servers (rl.py's), None where they load full weights."""
    import secrets

    import torch

    from lib.config import given_api_key
    from lib.inference import launch
    from lib.sampling import bounded

    with autocast():  # bf16 on either side, the weights served or the trainer's matmuls, rounds as bf16
        bf16_trainer = torch.is_autocast_enabled(torch.device(device).type)
    tolerance = cfg.inference.probe_tolerance
    if not tolerance:
        exact = save_dtype == torch.float32 and not bf16_trainer
        tolerance = 1e-3 if exact else probing.BF16_PROBE_TOLERANCE
    api_key = given_api_key(cfg.inference.api_key)
    if api_key is None and not cfg.inference.urls:
        # A server of its own gets a key of its own (in its environment, never on a command line or on
        # disk): no other local user can pause it or load another directory into it.
        api_key = secrets.token_urlsafe(24)
    cleanup.enter_context(endpoint.key_in_environment(api_key))
    urls, names, _ = launch.start_or_attach(
        cfg.inference,
        model=cfg.model,
        trainer_dtype=str(save_dtype).removeprefix("torch."),
        model_limit=getattr(model.config, "max_position_embeddings", cfg.seq_len),
        seq_len=cfg.seq_len,
        device=device,
        on_policy=cfg.max_async_level == 0,
        run_dir=cfg.output_dir,
        api_key=api_key,
        cleanup=cleanup,
        say=say,
        lora_rank=cfg.lora.rank if adapter else 0,
        return_sampling_mask=kept_set == "served",
    )
    sampling = bounded(cfg.sampling)
    servers = Servers(urls, names, api_key, cfg.inference.pause_mode, adapter, tolerance)
    servers.top_k, servers.top_p, servers.kept_set = sampling.top_k, sampling.top_p, kept_set
    servers.sender = transfer.sender(cfg.inference, urls, api_key, device, say)  # None: from the disk
    if kept_set != "none":
        source = "served by the engine" if kept_set == "served" else "recomputed by the trainer"
        say(f"top_k {sampling.top_k}, top_p {sampling.top_p}: each token's kept set is {source}")
    return servers


def publish(
    run_dir: Path,
    step: int,
    model,
    *,
    tokenizer,
    save_dtype,
    autocast,
    servers: Servers,
    keep_weights: int,
    merged: bool,
    when: str,
    memory: bool = False,
    write: bool = True,
) -> tuple[float, float]:
    """Writes weights/step_N (lib/trainer/servable.py), has every server load it and checks that each serves it:
    its label, and the probe scored by the trainer too (every rank takes part: under FSDP the forward is
    collective). Returns the seconds it took and the largest mean |logprob difference| from the trainer.

    A server that cannot take the weights, or serves something else, stops the run with one sentence
    naming it; checkpoints stay as they were, so `--resume` continues once the server is fixed. With
    `memory` the weights are broadcast instead, and weights/step_N written only where `write`."""
    began = time.perf_counter()
    adapter = servers.adapter is not None
    weights = transfer.step_tensors(model, save_dtype) if memory else None
    if write or not memory:
        path = save_weights(run_dir, step, model, tokenizer, save_dtype, keep_weights, adapter, merged)
        weights = path if weights is None else weights
    label, probes = f"step_{step}", []
    prompt = tokenizer.encode(probing.PROBE_TEXT, add_special_tokens=False)
    if servers.urls:
        servers.reload(weights, label)
        probes = [
            probing.probe(url, name, prompt, servers.api_key, servers.top_k, servers.top_p)
            for url, name in zip(servers.urls, servers.names)
        ]
    world_size = dist.world()[2]
    probes = dist.scatter([probes] * world_size)
    differences = []
    for answer in probes:
        kept = probing.probe_kept_sets(servers, answer, len(prompt))
        scored = probing.trainer_logprobs(model, autocast, prompt, answer.completion_ids, kept)
        # A token outside the trainer's recomputed kept set (a boundary the two sides round apart) has no
        # logprob there: it is left out of the comparison, as the loss leaves it out.
        scored = [t if math.isfinite(t) else s for t, s in zip(scored, answer.logprobs)]
        if servers.urls:
            differences.append(probing.compare(answer, scored, label, servers.probe_tolerance, when))
    return time.perf_counter() - began, max(differences, default=0.0)


class Reloader:
    """Reloads the servers in a thread of its own while the trainer goes on (rl.py at max_async_level >= 1),
    one step at a time. The trainer writes weights/step_N (a collective, in the loop's order on every rank)
    and start()s its reload; before writing step N+1 it wait()s for reload N, so at most one sync is in
    flight and pruning never deletes what a reload reads. A reload checks what it can without the trainer's
    live weights: the weight check inside reload_weights and the served label; the logprob probe, which
    needs a trainer forward, runs only at the start of a run. Then `on_loaded(N)` (the producer's
    set_version) lets new rollouts start on step N's weights."""

    def __init__(self, servers: Servers, tokenizer, on_loaded):
        self.servers, self.on_loaded = servers, on_loaded
        self.prompt = tokenizer.encode(probing.PROBE_TEXT, add_special_tokens=False)
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-sync")
        self.pending: concurrent.futures.Future | None = None

    def start(self, step: int, weights: Path | dict) -> None:
        """Loads `weights` (a directory, or {name: tensor} sent in memory) beside the trainer."""
        assert self.pending is None, "one sync at a time: wait() for the previous one first"
        self.pending = self.executor.submit(self._reload, step, weights)

    def _reload(self, step: int, weights: Path | dict) -> float:
        began, label, servers = time.perf_counter(), f"step_{step}", self.servers
        servers.reload(weights, label)
        for url, name in zip(servers.urls, servers.names):
            answer = probing.probe(url, name, self.prompt, servers.api_key, servers.top_k, servers.top_p)
            probing.check_label(answer, label, f"after step {step}")
        self.on_loaded(step)
        return time.perf_counter() - began

    def in_flight(self) -> bool:
        return self.pending is not None and not self.pending.done()

    def wait(self) -> tuple[float, float]:
        """Blocks until the reload in flight has finished, re-raising its error; returns the seconds waited
        here and the seconds the reload took (0, 0 when none was in flight)."""
        if self.pending is None:
            return 0.0, 0.0
        began = time.perf_counter()
        try:
            reload_seconds = self.pending.result()
        finally:
            self.pending = None
        return time.perf_counter() - began, reload_seconds

    def close(self) -> None:
        """Lets a reload in flight finish (a server must not stay paused), then stops the thread."""
        self.executor.shutdown(wait=True)


class WeightSync:
    """How each step's weights reach a run's servers. On-policy (`background` False) the loop publishes them
    (write, reload, probe) before the next step's rollouts; at max_async_level >= 1 it writes them and a
    Reloader loads them beside the next step's training. Every rank calls publish() and after_step()
    (writing weights is a collective); rank 0 attach()es the producer's set_version, called once the
    servers serve a step. The last step's weights are written merged too."""

    def __init__(
        self, run_dir: Path, model, servers: Servers, *, background: bool, last_step: int, **options
    ):
        self.run_dir, self.model, self.servers = run_dir, model, servers
        self.background, self.last_step = background, last_step
        self.tokenizer, self.save_dtype, self.autocast = (
            options["tokenizer"],
            options["save_dtype"],
            options["autocast"],
        )
        self.keep_weights, self.save_merged = options["keep_weights"], options["save_merged"]
        # In memory (inference.weight_sync), weights/step_N is written every `write_every` steps and at the last.
        self.memory, self.write_every = options.get("memory", False), options.get("write_every", 1)
        self.on_loaded, self.reloader = None, None
        # Between syncs, a server paused by someone else (a controller killed mid-sync) stops the run.
        self.pause_watch = endpoint.PauseWatch(servers.urls, servers.api_key)

    def attach(self, on_loaded) -> None:
        """Rank 0: `on_loaded(N)` follows each load of step N's weights."""
        self.on_loaded = on_loaded
        if self.background:
            self.reloader = Reloader(self.servers, self.tokenizer, on_loaded)

    def merged(self, step: int) -> bool:
        """Whether step N's weights are also written merged (--save-merged, or the last step)."""
        return self.save_merged or step == self.last_step

    def written(self, step: int) -> bool:
        """Whether step N's weights/step_N is written: every step from the disk, else at the checkpoints'
        steps and the last."""
        return not self.memory or step % self.write_every == 0 or step == self.last_step

    def publish(self, step: int, when: str) -> tuple[float, float]:
        """publish() of step N's weights: (seconds, probe difference)."""
        return publish(
            self.run_dir, step, self.model, tokenizer=self.tokenizer, save_dtype=self.save_dtype,
            autocast=self.autocast, servers=self.servers, keep_weights=self.keep_weights,
            merged=self.merged(step), when=when, memory=self.memory, write=self.written(step),
        )  # fmt: skip

    def after_step(self, step: int) -> dict[str, float]:
        """Step N's weights to the servers: published before this returns, or (background) written once reload
        N-1 is done, so one sync is in flight and pruning keeps what it reads, then reloaded beside the next
        step. Returns its time/sync_weights, time/wait_sync and, on-policy, sync/probe_logprob_difference."""
        if not self.background:
            seconds, difference = self.publish(step, f"after step {step}")
            if self.on_loaded:
                self.on_loaded(step)
            return {
                "time/sync_weights": seconds,
                "time/wait_sync": seconds,
                "sync/probe_logprob_difference": difference,
            }
        waited, seconds = self.reloader.wait() if self.reloader else (0.0, 0.0)
        weights = transfer.step_tensors(self.model, self.save_dtype) if self.memory else None
        if self.written(step):
            path = save_weights(
                self.run_dir, step, self.model, self.tokenizer, self.save_dtype, self.keep_weights,
                adapter=self.servers.adapter is not None, merged=self.merged(step),
            )  # fmt: skip
            weights = path if weights is None else weights
        if self.reloader:
            self.reloader.start(step, weights)
        # The logprob probe runs at the start only (Reloader), so no figure for it here, rather than a 0 that
        # reads as perfect agreement; seconds is the last finished reload's.
        return {"time/sync_weights": seconds, "time/wait_sync": waited}

    def in_flight(self) -> bool:
        return self.reloader is not None and self.reloader.in_flight()

    def check_servers(self) -> None:
        """While rollouts are awaited: every server answers /health and none stays paused (but by this run's
        own reload in flight)."""
        endpoint.check_servers(self.servers.urls, self.servers.api_key)
        self.pause_watch.check(own_sync=self.in_flight())

    def wait(self) -> None:
        """Until the servers serve the last weights written (before an eval or a checkpoint)."""
        if self.reloader:
            self.reloader.wait()

    def close(self) -> None:
        """Lets a reload in flight finish (a server must not stay paused), then the servers leave the group."""
        if self.reloader:
            self.reloader.close()
        if self.servers.sender is not None:
            self.servers.sender.close()


def weight_sync_mode(cfg, device: str, adapter: bool) -> str:
    """rl.py's inference.weight_sync (cfg: its Config) resolved, checked before anything starts. auto =
    memory where rl.py starts its server on a CPU and sends it full weights (the group forms over gloo on
    this machine: no file a step, the trainer blocked for a copy instead of a write; docs/server.md's
    figures), disk elsewhere: an attached server (a vLLM one takes memory only when started with
    --weight-transfer-config), a LoRA adapter (`adapter`), and GPUs, where a trainer and a server on one
    device cannot be two ranks of an NCCL group. Refused: memory with an adapter, and any full sync into a
    mixture of experts on vLLM's CPU build, which packs its weights once and copies reloaded ones in
    unpacked (measured: greedy tokens off transformers' from the first reload; docs/server.md)."""
    config, model = cfg.inference, cfg.model
    if config.weight_sync == "memory" and adapter:
        raise UserError(
            "inference.weight_sync memory sends full weights: LoRA runs sync their adapter from the disk "
            "(pass --inference.lora-sync merged to send the merged model, or leave weight_sync at auto)."
        )
    mode, cpu = config.weight_sync, device.startswith("cpu")
    if mode == "auto":
        mode = "disk" if config.urls or adapter or not cpu else "memory"
    if config.urls or config.engine != "vllm" or not cpu or adapter:
        return mode
    from transformers import AutoConfig

    from lib.models.load import loading

    with loading(model.name):
        text = AutoConfig.from_pretrained(model.name).get_text_config()
    if any(getattr(text, name, None) for name in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise UserError(
            f"{model.name} is a mixture of experts, whose weights vLLM's CPU build garbles on every reload: "
            "train it with --inference.engine torch on CPU, or with LoRA adapters (--inference.lora-sync "
            "adapter)."
        )
    return mode
