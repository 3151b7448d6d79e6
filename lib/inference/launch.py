"""Inference servers from the controller's side: their settings (InferenceConfig); start scripts/serve.py on a
free loopback port (or attach to running ones), wait for /health, stop it."""

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

from lib import rundir
from lib.config import UserError
from lib.endpoint import check_base_url, is_healthy, model_card, served_model
from lib.models.load import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
# The name a LoRA run's adapter is loaded under (in place, every step) and its requests ask for.
ADAPTER_NAME = "policy-adapter"


@dataclasses.dataclass
class InferenceConfig:
    urls: list[str] = dataclasses.field(default_factory=list)
    """Attach to these servers (base URLs ending in /v1); empty = start one with serve.py."""
    api_key: str | None = None
    """Bearer key of the servers (default: $PLAINRL_API_KEY if set)."""
    engine: Literal["auto", "torch", "vllm"] = "auto"
    """Engine of the server rl.py starts (auto: vLLM when installed and a GPU is visible)."""
    port: int = 0
    """Port of the server rl.py starts (0 = a free one)."""
    gpu_memory_utilization: float = 0.3
    """GPU memory share of the vLLM server rl.py starts (it shares the GPU with the trainer)."""
    max_concurrent: int = 64
    """Most episodes in flight at once."""
    # Measured (benchmarks/inference/bench_pause_mode.py: configs/tiny/rl.toml on the 300-step SFT tiny
    # model, max_async_level 1, 2 x 11 timed steps per mode, everything on one CPU core): builtin engine
    # wait 1.206 s/step, keep 1.158 (0.96x); vLLM CPU build wait 2.493, keep 2.727 (1.09x). keep halves
    # the sync (vLLM 0.88 -> 0.46 s) but the held completions, recomputed, still need the same core
    # afterwards (rollout wait 0.14 -> 0.56 s): no gain here, so wait stays the default. On a GPU with
    # long completions (thousands of tokens, lengths spread) expect keep to win: wait idles the trainer
    # and the GPU's batch for the longest completion's tail at every step, while keep's costs are one
    # prefill of the held histories (cheap next to decoding them) and some tokens from the newer policy
    # (the per-token inference logprobs and the older version tag keep the loss correct).
    pause_mode: Literal["wait", "keep"] = "wait"
    """How a weight sync pauses the servers: wait = each sync waits for the longest in-flight completion,
    which ends on the old weights; keep = in-flight completions are held and go on under the new weights,
    their later tokens carrying the new label and logprobs (the loss uses per-token inference logprobs)."""
    probe_tolerance: float | None = None
    """Largest mean |logprob difference| allowed between a server and the trainer on the probe that
    follows every weight load; past it the run stops. None = 1e-3 when the trainer computes in float32,
    where engines agree to ~1e-6, and 0.25 in bfloat16, provisional: bf16 engines differed by up to 0.125
    at the Qwen3-0.6B shape on CPU (lib/inference/weights/probing.py BF16_PROBE_TOLERANCE)."""
    lora_sync: Literal["adapter", "merged"] = "adapter"
    """LoRA runs: adapter = each step writes the adapter alone (MBs) and the servers load it at run time
    through /v1/load_lora_adapter, a started server getting --max-lora-rank; merged = the whole model,
    merged, is written and reloaded, for servers run without LoRA."""
    weight_sync: Literal["auto", "disk", "memory"] = "auto"
    """How each step's full weights reach the servers: disk = weights/step_N written, every server reloads it
    (a shared file system across nodes); memory = rank 0 broadcasts them into every server's engines (vLLM's
    weight-transfer routes, lib/inference/weights/transfer.py; an attached vLLM needs --weight-transfer-config), weights/step_N
    then written at checkpoints only; both are fingerprinted. auto = memory where rl.py starts its server on
    a CPU, disk elsewhere (attached servers, GPUs; docs/server.md has the figures). LoRA adapters always go
    by disk."""
    vllm_transfer_backend: str | None = None
    """memory sync with vLLM: its --weight-transfer-config backend (None = nccl, vLLM's own, on GPUs, and
    plainrl_gloo, plainrl's engine, on CPUs, where vLLM's nccl does nothing)."""

    def __post_init__(self):
        for url in self.urls:
            check_base_url(url, "inference.urls")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise UserError("inference.gpu_memory_utilization must be in (0, 1].")
        if self.max_concurrent < 1:
            raise UserError("inference.max_concurrent must be at least 1.")
        if self.probe_tolerance is not None and self.probe_tolerance <= 0:
            raise UserError("inference.probe_tolerance must be positive.")


@dataclasses.dataclass
class Server:
    """A serve.py subprocess this process started (and must stop)."""

    process: subprocess.Popen
    url: str
    """OpenAI-compatible base URL, e.g. http://127.0.0.1:41234/v1."""
    log_path: Path
    """Where the server's stdout and stderr go."""

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited after `timeout` seconds. A server that froze (SIGSTOP)
        is continued, so that it ends at once rather than after `timeout`."""
        if self.process.poll() is None:
            self.process.terminate()
            self.process.send_signal(signal.SIGCONT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def die_with_parent() -> None:
    """In the child: the kernel sends SIGTERM when the parent dies, even by kill -9 (Linux only)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free now. Every socket stays bound until all are picked: ports taken one at a
    time can repeat (two of a SLURM cluster's four once did)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(contextlib.closing(socket.socket())) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def free_port() -> int:
    return free_ports(1)[0]


def server_environment(api_key: str | None, threads: int | None) -> dict[str, str]:
    """A started server's environment: the key goes there (serve.py reads PLAINRL_API_KEY), never on its
    command line, which every local user can read (ps, /proc/PID/cmdline)."""
    env = {name: value for name, value in os.environ.items() if name != "PLAINRL_API_KEY"}
    if api_key:
        env["PLAINRL_API_KEY"] = api_key
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def serves_kept_sets(engine: str, device: str) -> bool:
    """Whether the server rl.py starts can return each sampled token's kept ids: the builtin engine can, and
    vLLM on GPUs (--return-sampling-mask needs Model Runner V2, which vLLM 0.32's CPU build cannot run).
    engine auto picks the builtin engine where no GPU is visible."""
    return not (engine == "vllm" and device == "cpu")


def kept_set_mode(cfg, device: str) -> str:
    """How rl.py's trainer knows each sampled token's kept set (its Config.kept_set, resolved the same way on
    every rank): none without top-k/top-p, else as asked, and on auto served by a server rl.py starts that
    can, recomputed by the trainer otherwise. top_p alone samples with top_k 512 (lib/sampling.py bounded)."""
    from lib.sampling import bounded

    sampling = bounded(cfg.sampling)
    if sampling.top_k < 0 and sampling.top_p == 1:
        return "none"
    if cfg.kept_set != "auto":
        return cfg.kept_set
    own = not cfg.inference.urls and serves_kept_sets(cfg.inference.engine, device)
    return "served" if own else "recomputed"


def transfer_backend(config: InferenceConfig, device: str) -> str:
    """vLLM's weight-transfer engine for an in-memory sync: vllm_transfer_backend, else nccl on GPUs and
    plainrl's gloo engine on CPUs (vLLM's CPU build answers nccl's broadcast by doing nothing)."""
    return config.vllm_transfer_backend or ("nccl" if device.startswith("cuda") else "plainrl_gloo")


def start_server(
    model: str,
    port: int | None = None,
    engine: str = "auto",
    api_key: str | None = None,
    weights_root: Path | None = None,
    log_path: Path | None = None,
    extra_args: list[str] | None = None,
    timeout: float = 600.0,
    threads: int | None = None,
) -> Server:
    """Starts `python scripts/serve.py` for `model` on loopback and returns once GET /health is 200.

    `threads` caps the server's CPU threads (OMP_NUM_THREADS): a trainer and a server sharing a few
    cores, each with a thread per core, slow each other down many times over. `port` None picks a free one. If the server exits, or is not healthy within `timeout` seconds, it
    is stopped and the end of its log is raised as a RuntimeError.
    """
    port = port or free_port()
    command = [sys.executable, str(ROOT / "scripts" / "serve.py"), "--model.name", model, "--port", str(port)]
    command += ["--engine", engine]
    command += [*(["--weights-root", str(weights_root)] if weights_root else []), *(extra_args or [])]
    log_path = Path(log_path or Path("outputs") / "logs" / f"serve-{port}.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
            process_group=0,  # a Ctrl-C in the terminal reaches the controller, which stops the server itself
            env=server_environment(api_key, threads),
        )
    server = Server(process, f"http://127.0.0.1:{port}/v1", log_path)
    deadline = time.monotonic() + timeout
    try:
        while not is_healthy(server.url, api_key):
            exited = process.poll() is not None
            if exited or time.monotonic() > deadline:
                reason = (
                    f"exited with code {process.returncode}"
                    if exited
                    else f"was not healthy after {timeout:.0f} s"
                )
                tail = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the inference server {reason}; end of {log_path}:\n{tail}")
            time.sleep(0.2)
    except BaseException:  # also Ctrl-C: in its own process group, the server does not get it
        server.stop()
        raise
    return server


@contextlib.contextmanager
def running_server(model: str, **kwargs):
    """`with running_server(model) as server:` starts a server and always stops it."""
    server = start_server(model, **kwargs)
    try:
        yield server
    finally:
        server.stop()


def cpu_threads(on_policy: bool, cores: int) -> tuple[int, int]:
    """(trainer's, server's) threads when rl.py's trainer and the server it starts share `cores` CPU cores.
    Asynchronous, both work at once: the cores are split, not oversubscribed. Measured on 2 shared, busy cores
    (docs/benchmarks.md, the core split): trainer 1 / server 1 thread 9.7 and 2.9 s a step in two runs,
    trainer 2 / server 1 12.5 and 4.8 s (training 2.8-2.9x slower): three threads on two cores stall each
    other, as a 2-thread plain loop does (74 new tokens/s against ~1,000 at 1 thread). On-policy they take
    turns (the server generates while the trainer waits for its rollouts, then the server waits while it
    trains), so each takes every core in its turn."""
    if on_policy:
        return cores, cores
    server = max(1, cores // 2)
    return max(1, cores - server), server


def start_or_attach(
    config: InferenceConfig,
    *,
    model: ModelConfig,
    trainer_dtype: str,
    model_limit: int,
    seq_len: int,
    device: str,
    on_policy: bool,
    run_dir: Path,
    api_key: str | None,
    cleanup: contextlib.ExitStack,
    say=print,
    lora_rank: int = 0,
    return_sampling_mask: bool = False,
) -> tuple[list[str], list[str], Server | None]:
    """rl.py's servers: attaches to config.urls, or starts one on model.name (`cleanup` stops it), taking
    LoRA adapters of `lora_rank` at run time when that is > 0 and returning each sampled token's kept ids
    with `return_sampling_mask`. Returns
    their base URLs, the model name each answers to, and the started server (None when attached), and
    writes run_dir/provenance.json. `trainer_dtype` is what the trainer saves ("float32", "bfloat16"),
    `model_limit` the model's own context length."""
    from lib.provenance import write_provenance

    urls, server = list(config.urls), None
    if not urls:
        threads = None
        if device == "cpu":
            import torch

            trainer_threads, threads = cpu_threads(on_policy, os.cpu_count() or 2)
            torch.set_num_threads(trainer_threads)
        server = start_server(
            model.name,
            config.port or None,
            config.engine,
            api_key,
            weights_root=run_dir.resolve(),
            log_path=run_dir / rundir.SERVER_LOG,
            extra_args=[
                # The dtype the trainer writes its weights in (lib/models/load.py runs_in_dtype), so the two agree.
                *("--model.dtype", model.dtype if model.dtype != "auto" else trainer_dtype),
                *("--vllm.gpu-memory-utilization", str(config.gpu_memory_utilization)),
                # No episode longer than the trainer's rows, nor than the model's own context: the model's
                # limit (262k tokens for some) would ask for more KV cache than a shared GPU has.
                *("--max-model-len", str(min(seq_len, model_limit))),
                *("--max-lora-rank", str(lora_rank)),
                *(["--return-sampling-mask"] if return_sampling_mask else []),
                # vLLM's weight-transfer engine for an in-memory sync (lib/inference/weights/transfer.py).
                *(
                    ["--vllm.weight-transfer-backend", transfer_backend(config, device)]
                    if config.weight_sync == "memory"
                    else []
                ),
            ],
            threads=threads,
        )
        cleanup.callback(server.stop)
        urls = [server.url]
    # An attached server may serve the starting point under another name (the hub id it was started
    # with, say): requests use that name, and it gets the run's weights at the first reload.
    names = [served_model(url, api_key) if config.urls else model.name for url in urls]
    if lora_rank:  # requests name the adapter; the base weights must be the run's (the probe checks)
        names = [ADAPTER_NAME] * len(urls)
    for url in urls:
        longest = model_card(url, api_key).get("max_model_len") or 0
        if longest > seq_len:
            say(
                f"WARNING: {url} serves sequences of up to {longest} tokens, more than seq_len {seq_len}: "
                f"each request's max_tokens is cut to fit seq_len, and a group whose episode still outgrows it "
                f"is dropped (start the server with --max-model-len {seq_len} to refuse such prompts there)"
            )
    commands = [server.process.args] if server else [None] * len(urls)  # attached: not known here
    write_provenance(run_dir, [{"url": u, "command": c} for u, c in zip(urls, commands)], api_key)
    return urls, names, server


def open_teacher(cfg, *, api_key: str | None, device: str, cleanup: contextlib.ExitStack, say=print):
    """rl.py's distillation teacher (cfg: its Config), a lib/orchestrator/teacher.py Teacher, or None without one:
    attached to teacher.urls (the key from the environment), or a server started on teacher.model as the
    policy's is (inference.engine, the policy server's `api_key`, teacher.log; `cleanup` stops it), long enough
    for a rollout of seq_len and the one token a scoring request generates. An attached teacher given no
    teacher.model has its tokenizer checked from the directory its server names (rl.py checks teacher.model's)."""
    from lib.config import given_api_key
    from lib.orchestrator import teacher

    if not cfg.teacher.enabled:
        return None
    if cfg.teacher.urls:
        urls, api_key = list(cfg.teacher.urls), given_api_key(cfg.inference.api_key)
        names = [served_model(url, api_key) for url in urls]
        if not cfg.teacher.model:
            teacher.check_tokenizer(cfg.model.name, model_card(urls[0], api_key).get("root") or names[0])
    else:
        from transformers import AutoConfig

        limit = getattr(AutoConfig.from_pretrained(cfg.teacher.model), "max_position_embeddings", None)
        server = start_server(
            cfg.teacher.model,
            engine=cfg.inference.engine,
            api_key=api_key,
            log_path=cfg.output_dir / rundir.TEACHER_LOG,
            extra_args=["--max-model-len", str(min(cfg.seq_len + 1, limit or cfg.seq_len + 1))],
            threads=max(1, (os.cpu_count() or 2) // 2) if device == "cpu" else None,
        )
        cleanup.callback(server.stop)
        urls, names = [server.url], [cfg.teacher.model]
    say(f"teacher {cfg.teacher.model or names[0]}: {' '.join(urls)}")
    return teacher.Teacher(urls, names, api_key)
