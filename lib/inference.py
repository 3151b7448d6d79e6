"""Inference servers from the controller's side: their settings (InferenceConfig); start scripts/serve.py on a
free loopback port (or attach to running ones), wait for /health, watch it, stop it."""

import contextlib
import dataclasses
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Literal

import httpx

from lib import rundir
from lib.config import UserError
from lib.model import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
# How often the controller checks a server's /health while it waits on it (rollouts, a reload).
HEALTH_EVERY_S = 5.0
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
    # Measured (benchmarks/bench_pause_mode.py: configs/tiny/rl.toml on the 300-step SFT tiny model,
    # max_async_level 1, 2 x 11 timed steps per mode, everything on one CPU core): builtin engine
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
    at the Qwen3-0.6B shape on CPU (lib/probing.py BF16_PROBE_TOLERANCE)."""
    lora_sync: Literal["adapter", "merged"] = "adapter"
    """LoRA runs: adapter = each step writes the adapter alone (MBs) and the servers load it at run time
    through /v1/load_lora_adapter, a started server getting --max-lora-rank; merged = the whole model,
    merged, is written and reloaded, for servers run without LoRA."""

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
        """SIGTERM, then SIGKILL if it has not exited after `timeout` seconds."""
        if self.process.poll() is None:
            self.process.terminate()
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


def headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@functools.cache
def ssl_context():
    """httpx's default certificate check, built once: httpx builds one for every client and every httpx.get
    (loading the CA bundle, 0.02-0.13 s of CPU on 2 cores), and the loop talks to its servers every step."""
    return httpx.create_ssl_context()


def is_healthy(base_url: str, api_key: str | None = None, timeout: float = 2.0) -> bool:
    """Whether GET /health (next to /v1) answers 200."""
    try:
        response = httpx.get(
            f"{root_url(base_url)}/health", headers=headers(api_key), timeout=timeout, verify=ssl_context()
        )
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def check_servers(urls: list[str], api_key: str | None = None, timeout: float = 5.0) -> None:
    """A one-sentence ValueError for the first server that is gone (refuses connections) or stuck (does not
    answer GET /health within `timeout` seconds, as a stopped process does)."""
    for url in urls:
        root = root_url(url)
        try:
            response = httpx.get(
                f"{root}/health", headers=headers(api_key), timeout=timeout, verify=ssl_context()
            )
        except httpx.TimeoutException:
            raise UserError(
                f"the inference server {root} did not answer /health within {timeout:.0f} s (is it frozen?)"
            ) from None
        except httpx.TransportError as error:
            raise UserError(f"the inference server {root} is not reachable ({error}): did it stop?") from None
        if response.status_code != 200:
            raise UserError(f"the inference server {root} answered /health with {response.status_code}")


# A client waiting on a server that has been paused this long by someone else (a controller killed between
# /pause and /resume, any client's POST /pause) stops with one sentence instead of waiting forever.
PAUSED_PATIENCE_S = 60.0
# How often a server seen paused is asked again: a pause counts only while no answer says it ended, so a
# server that another run pauses briefly at every step (its reloads) never adds up to PAUSED_PATIENCE_S.
PAUSE_POLL_S = 0.1


class PauseWatch:
    """Stops a client that waits on servers someone else keeps paused: rl.py while the producer's take()
    waits, eval.py and rl.py's evaluations while their rollouts run. Both engines answer GET /is_paused
    without a key.

    A server seen paused is asked again every PAUSE_POLL_S until it says otherwise. One answer per check
    (every HEALTH_EVERY_S) could not tell one long pause from brief ones that every check landed in."""

    def __init__(self, urls: list[str], api_key: str | None = None, patience: float | None = None):
        self.urls, self.api_key = urls, api_key
        self.patience = PAUSED_PATIENCE_S if patience is None else patience
        self.stop = threading.Event()
        """Set when the caller stopped waiting (Ctrl-C): a check polling in another thread then returns."""

    def check(self, own_sync: bool = False) -> None:
        """Returns once no server is paused; a UserError names the first one paused for `patience` seconds
        without a break. A server that cannot say is left to the health check. With `own_sync` (this
        process's reload in flight) it returns at once: the thread that calls it is the one that starts
        reloads, so none starts while it watches."""
        if own_sync:
            return
        with httpx.Client(headers=headers(self.api_key), timeout=5.0, verify=ssl_context()) as http:
            for url in self.urls:
                root = root_url(url)
                began = time.monotonic()
                while is_paused(http, root):
                    paused_seconds = time.monotonic() - began
                    if paused_seconds >= self.patience:
                        raise UserError(
                            f"the inference server {root} has been paused for {paused_seconds:.0f} s by "
                            f"another client (a controller stopped between /pause and /resume?): nothing it "
                            f"was asked will finish; resume it with `curl -X POST {root}/resume` (with its "
                            f"key) or restart it"
                        )
                    if self.stop.wait(PAUSE_POLL_S):
                        return


def is_paused(http: httpx.Client, root: str) -> bool:
    """Whether the server answers GET /is_paused with true (False when it cannot say)."""
    try:
        paused = http.get(f"{root}/is_paused").json()
    except (httpx.HTTPError, ValueError):
        return False
    return isinstance(paused, dict) and paused.get("is_paused") is True


async def unless_paused(coroutine, watch: PauseWatch, every: float | None = None):
    """Awaits `coroutine`, running watch.check() every `every` seconds: a server paused too long cancels it
    and raises the watch's UserError."""
    import asyncio

    task = asyncio.ensure_future(coroutine)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=HEALTH_EVERY_S if every is None else every)
            if done:
                return task.result()
            try:
                await asyncio.to_thread(watch.check)
            except UserError:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise
    finally:
        watch.stop.set()  # else asyncio.run waits, after Ctrl-C, for a check still polling in its thread


def check_base_url(base_url: str, name: str = "the base URL") -> str:
    """The OpenAI-style base URL without a trailing slash; ValueError unless it ends in /v1."""
    base_url = base_url.rstrip("/")
    if not base_url.endswith("/v1"):
        raise UserError(f"{name} must end in /v1, e.g. http://localhost:8000/v1, got {base_url}.")
    return base_url


def served_model(base_url: str, api_key: str | None = None) -> str:
    """The model id a running server answers to (the first in GET /v1/models): requests must name it."""
    return model_card(base_url, api_key)["id"]


def model_card(base_url: str, api_key: str | None = None) -> dict:
    """The first model of GET /v1/models (its `id`, and `max_model_len` on vLLM and the builtin engine)."""
    base_url = check_base_url(base_url)
    try:
        response = httpx.get(f"{base_url}/models", headers=headers(api_key), timeout=30, verify=ssl_context())
        response.raise_for_status()
        card = response.json()["data"][0]
        if not isinstance(card.get("id"), str):
            raise LookupError("no model id")
        return card
    except httpx.HTTPStatusError as error:
        status = error.response.status_code
        raise UserError(
            f"{base_url}/models answered {status} (a wrong API key, or not an inference server)"
        ) from None
    except httpx.HTTPError as error:
        raise UserError(f"cannot reach the inference server {base_url} ({error})") from None
    except (ValueError, LookupError, TypeError):
        raise UserError(f"{base_url}/models does not list a model: is it an inference server?") from None


def check_reachable(base_url: str, api_key: str | None = None) -> None:
    """A one-sentence UserError when nothing answers at base_url (refused, unknown host, no answer in 30 s).
    Any HTTP answer passes: an endpoint need not serve /models, and its own errors say more."""
    base_url = check_base_url(base_url)
    try:
        httpx.get(f"{base_url}/models", headers=headers(api_key), timeout=30, verify=ssl_context())
    except httpx.HTTPError as error:
        raise UserError(f"cannot reach the inference server {base_url} ({error})") from None


def root_url(base_url: str) -> str:
    """http://host:port/v1 -> http://host:port (where /health and the admin routes live)."""
    return base_url.rstrip("/").removesuffix("/v1")


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


def check_full_sync(config: InferenceConfig, model: ModelConfig, device: str, adapter: bool) -> None:
    """Refuses, before anything starts, the server rl.py would start that cannot take full weights: vLLM's
    CPU build packs a mixture of experts' weights once, and its in-place reload copies the new ones in
    unpacked (measured: greedy tokens off transformers' from the first reload; docs/server.md)."""
    if config.urls or config.engine != "vllm" or device != "cpu" or adapter:
        return
    from transformers import AutoConfig

    from lib.model import loading

    with loading(model.name):
        text = AutoConfig.from_pretrained(model.name).get_text_config()
    if any(getattr(text, name, None) for name in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise UserError(
            f"{model.name} is a mixture of experts, whose weights vLLM's CPU build garbles on every reload: "
            "train it with --inference.engine torch on CPU, or with LoRA adapters (--inference.lora-sync "
            "adapter)."
        )


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
            # Trainer and server share the cores: split them rather than oversubscribe. On-policy, the
            # server idles while the trainer trains, so the trainer takes every core. Measured on 2 shared,
            # busy cores (docs/benchmarks.md, the core split): trainer 1 / server 1 thread 9.7 and 2.9 s a
            # step in two runs, trainer 2 / server 1 12.5 and 4.8 s (training 2.8-2.9x slower): three
            # threads on two cores stall each other, as a 2-thread plain loop does (74 new tokens/s against
            # ~1,000 at 1 thread).
            import torch

            cores = os.cpu_count() or 2
            threads = max(1, cores // 2)
            torch.set_num_threads(cores if on_policy else max(1, cores - threads))
        server = start_server(
            model.name,
            config.port or None,
            config.engine,
            api_key,
            weights_root=run_dir.resolve(),
            log_path=run_dir / rundir.SERVER_LOG,
            extra_args=[
                # The dtype the trainer writes its weights in (lib/model.py runs_in_dtype), so the two agree.
                *("--model.dtype", model.dtype if model.dtype != "auto" else trainer_dtype),
                *("--vllm.gpu-memory-utilization", str(config.gpu_memory_utilization)),
                # No episode longer than the trainer's rows, nor than the model's own context: the model's
                # limit (262k tokens for some) would ask for more KV cache than a shared GPU has.
                *("--max-model-len", str(min(seq_len, model_limit))),
                *("--max-lora-rank", str(lora_rank)),
                *(["--return-sampling-mask"] if return_sampling_mask else []),
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
