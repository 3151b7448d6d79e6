"""Weight sync from the controller's side: make every server load weights/step_N (a full model, or a LoRA
adapter), and check it serves them."""

import concurrent.futures
import dataclasses
import json
import math
import re
import threading
import time
from pathlib import Path

import httpx

from lib import dist, fingerprint
from lib.checkpoint import save_weights
from lib.config import UserError
from lib.inference import HEALTH_EVERY_S, check_servers, headers, is_healthy, root_url, ssl_context

# /pause?mode=wait returns when the longest in-flight completion has finished (minutes for long GPU
# completions), and loading a large model takes a while too: a request may take this long, as long as
# the server keeps answering /health meanwhile. A server that dies or freezes fails that check within
# about 2 x HEALTH_EVERY_S, whatever it was doing.
REQUEST_TIMEOUT_S = 900.0
PROBE_TEXT = "The quick brown fox jumps over the lazy dog. 0123456789"
PROBE_TEMPERATURE = 0.5
PROBE_TOKENS = 8
# Provisional, from CPU only (benchmarks/bench_probe_tolerance.py, Qwen3-0.6B shape, both engines serving bf16,
# the trainer's float32 weights in float32 and under bf16 autocast): the mean |logprob difference| over 8
# probe tokens reached 0.125 on one prompt, and 0.045 averaged over 6 prompts, when the sampled tokens had
# probabilities around 0.06 (log -2.8), the most sensitive regime; random, briefly trained and very peaked
# models gave 0.003-0.023 on average. Twice the worst prompt, until GPU kernels are measured. So loose that
# a server left on the last step's weights passes it at real learning rates: what proves the weights is the
# fingerprint (check_fingerprint); the probe stays for what it alone sees (another model, chat template,
# logprobs mode, a LoRA adapter not applied).
BF16_PROBE_TOLERANCE = 0.25


def likely_cause(error: ValueError, directory: Path) -> str:
    """Why a server could not load `directory` (run_dir/weights/step_N), from its answer."""
    if "_path must be under" in str(error):  # the builtin engine's --weights-root refused it
        return f"the server's --weights-root must contain the run directory {directory.parents[1]}"
    return (
        f"is {directory} visible on that server's machine? (several nodes need the run directory on a "
        "shared file system, at the same path)"
    )


def post(http: httpx.Client, url: str, path: str, timeout: float = REQUEST_TIMEOUT_S, **kwargs) -> dict:
    """POST to a server's root, checking its /health every HEALTH_EVERY_S while waiting; a one-sentence
    ValueError if it is unreachable, frozen, silent past `timeout` or refuses."""
    root = root_url(url)
    outcome = {}

    def send():
        try:
            outcome["response"] = http.post(root + path, timeout=timeout, **kwargs)
        except httpx.HTTPError as error:
            outcome["error"] = error

    # A daemon thread, not an executor: a request stuck on a frozen server must not hold up the exit.
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    sender.join(HEALTH_EVERY_S)
    while sender.is_alive():
        check_servers([url])
        sender.join(HEALTH_EVERY_S)
    try:
        if "error" in outcome:
            raise outcome["error"]
        response = outcome["response"]
    except httpx.TimeoutException:
        raise UserError(
            f"the inference server {root} did not answer {path} within {timeout:.0f} s (is it frozen?)"
        ) from None
    except httpx.TransportError as error:
        raise UserError(f"the inference server {root} is not reachable ({error}): did it stop?") from None
    if response.status_code >= 400:
        raise UserError(
            f"the inference server {root} answered {path} with {response.status_code}: {response.text[:300]}"
        )
    if "json" not in response.headers.get("content-type", ""):
        return {}  # /v1/load_lora_adapter answers in plain text, on vLLM too
    return response.json()


def check_weights_dir(directory: Path, adapter: bool) -> None:
    """plainrl sends only complete weights directories it wrote (checkpoint.save_weights renames them into
    place whole); anything else is a bug, not a user error."""
    config = directory / ("adapter_config.json" if adapter else "config.json")
    assert config.is_file() and any(directory.glob("*.safetensors")), f"{directory} is not complete"


def load_adapter(http: httpx.Client, url: str, directory: Path, name: str) -> None:
    """Loads the LoRA adapter in `directory` under `name`, in place of the one loaded before."""
    body = {"lora_name": name, "lora_path": str(directory), "load_inplace": True}
    try:
        post(http, url, "/v1/load_lora_adapter", json=body)
    except ValueError as error:
        text = str(error)
        # No route (vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING, the builtin engine without
        # --max-lora-rank), or vLLM without --enable-lora, as against a path the server cannot read.
        if not ('"Not Found"' in text or "adapters are off" in text or "enable" in text.lower()):
            raise UserError(
                f"{error}; the server could not load {directory}: {likely_cause(error, directory)}"
            ) from None
        rank = json.loads((directory / "adapter_config.json").read_text())["r"]
        raise UserError(
            f"{error}; the server could not load the LoRA adapter {directory}: start it with runtime LoRA "
            f"(scripts/serve.py --max-lora-rank {rank}; plain vLLM: --enable-lora --max-lora-rank {rank} "
            "--max-loras 1 and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), or pass --inference.lora-sync merged"
        ) from None


def refresh_tied_output_layer(http: httpx.Client, url: str) -> None:
    """After a reload of a tied model: vLLM's CPU build would go on scoring with the old output layer
    (lib/vllm.py ServedWeights); the builtin engine and vLLM on GPUs have nothing to refresh."""
    try:
        post(http, url, "/collective_rpc", json={"method": "refresh_tied_output_layer"})
    except ValueError as error:
        raise UserError(
            f"{error}; a model whose output layer is its embedding needs vLLM started by scripts/serve.py "
            "(or with --worker-extension-cls lib.vllm.ServedWeights), which refreshes that layer on reload"
        ) from None


def check_fingerprint(http: httpx.Client, url: str, directory: Path, written: dict[str, list[float]]) -> None:
    """Asks the server for the fingerprint of what its engines compute with (lib/fingerprint.py) and stops the
    run in one sentence naming the first weight that is not the one written in `directory`.

    Each engine compares itself with `written` (with data parallel, vLLM's /collective_rpc answers with the
    first engine's result but fails when any engine fails), and the answer is compared here too."""
    root = root_url(url)
    body = {"method": "weight_fingerprint", "kwargs": {"written": json.dumps(written)}}
    try:
        answer = post(http, url, "/collective_rpc", json=body)
    except ValueError as error:
        # The engine's sentence, within the server's error answer (vLLM wraps it in quotes, in JSON).
        if found := re.search(r"(engine \d+) computes with other weights: (.*?\))", str(error)):
            raise UserError(
                f"the inference server {root} does not compute with the weights it loaded from {directory}: "
                f"in its {found[1]} the first differing weight is {found[2]}"
            ) from None
        if "weight_fingerprint" not in str(error):
            raise
        raise UserError(
            f"{error}; checking what the server computes with needs the builtin engine or vLLM started by "
            "scripts/serve.py (or with --worker-extension-cls lib.vllm.ServedWeights)"
        ) from None
    served = answer["results"][0]
    if "unsupported" in served:  # tensor-parallel vLLM engines: not covered (docs/server.md)
        return
    if difference := fingerprint.first_difference(written, served["weights"]):
        raise UserError(
            f"the inference server {root} does not compute with the weights it loaded from {directory}: "
            f"in its engine {served['engine']} the first differing weight is {difference}"
        )


def reload_weights(
    urls: list[str],
    directory: Path,
    api_key: str | None,
    label: str,
    pause_mode: str = "wait",
    adapter: str | None = None,
) -> None:
    """Makes every server serve `directory` under the label `label`, pausing it with `pause_mode`: a full
    model, or with `adapter` a LoRA adapter, loaded under that name (the base weights stay).

    A server that cannot take the weights or stops answering stops the run at once with one sentence
    naming it and the likely cause; rl.py's checkpoints stay as they were, so `--resume` continues once
    the server is fixed. No restart behind the user's back: a server that fails to load a directory
    would fail again on the same directory.

    pause_mode wait: /pause returns once in-flight requests have finished on the old weights. keep: it
    returns at once; in-flight requests are held and go on under the new weights after /resume (their
    later tokens carry the new label and the new policy's logprobs, which the loss uses per token)."""
    assert pause_mode in ("wait", "keep"), f"unknown pause mode {pause_mode!r}"
    directory = Path(directory).resolve()
    check_weights_dir(directory, adapter is not None)
    tied = not adapter and json.loads((directory / "config.json").read_text()).get("tie_word_embeddings")
    # From what was written, never from the trainer's weights; a LoRA adapter is not fingerprinted (vLLM keeps
    # it apart from the weights, in padded stacked buffers): the probe checks it.
    written = None if adapter else fingerprint.of_directory(directory)
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(directory)}}
    with httpx.Client(headers=headers(api_key), verify=ssl_context()) as http:
        for url in urls:
            # /resume goes to every server still answering whatever failed, the /pause itself included
            # (a pause that timed out on the client may still take effect on the server): a server left
            # paused would hold every later request, an attached eval's too, forever.
            try:
                post(http, url, f"/pause?mode={pause_mode}")
                if adapter:
                    load_adapter(http, url, directory, adapter)
                else:
                    try:
                        post(http, url, "/collective_rpc", json=rpc)
                    except ValueError as error:
                        raise UserError(
                            f"{error}; the server could not load {directory}: {likely_cause(error, directory)}"
                        ) from None
                if tied:
                    refresh_tied_output_layer(http, url)
                if written is not None:
                    check_fingerprint(http, url, directory, written)
                # vLLM 0.32 reports the label in every /inference/v1/generate choice as `weight_versions`,
                # one span per label; the builtin engine does the same.
                post(http, url, "/update_weight_version", json={"new_version": label})
                # KV that old weights computed must not survive (vLLM keys an adapter's prefix cache by its
                # name, which stays the same from step to step). vLLM keeps prefix-cached blocks that held
                # requests still use, so a plain /reset_prefix_cache answers success false and drops
                # nothing; reset_running_requests=true preempts the held requests, which recompute their
                # prompt and tokens so far under the new weights.
                reset = post(http, url, "/reset_prefix_cache?reset_running_requests=true")
                if not reset.get("success"):
                    raise UserError(
                        f"the inference server {root_url(url)} did not drop its cached KV after loading "
                        f"{directory} (/reset_prefix_cache answered {reset}): requests would reuse KV of the "
                        "old weights"
                    )
            finally:
                resume(url, api_key)


def resume(url: str, api_key: str | None, tries: int = 3) -> None:
    """POST /resume, each try on a connection of its own: after a 500 (vLLM's answer to a failed weight check)
    the server may close the keep-alive connection the client would reuse, and a /resume that never reached
    the server leaves it paused for good. A server that died or froze has nothing to resume (no second
    try): the error on the way out says what happened."""
    for attempt in range(tries):
        try:
            with httpx.Client(headers=headers(api_key), verify=ssl_context()) as http:
                post(http, url, "/resume")
            return
        except ValueError:
            if attempt + 1 == tries or not is_healthy(url, api_key):
                return
            time.sleep(0.5)


@dataclasses.dataclass
class Probe:
    """What one server sampled for the probe prompt."""

    url: str
    completion_ids: list[int]
    logprobs: list[float]
    label: str | None
    """The weight label of the answer (None when the server reports none)."""
    kept: list[list[int]] | None = None
    """Each token's kept ids, when the server returns them (`sampling_mask`)."""


def probe(
    url: str, model: str, prompt_ids: list[int], api_key: str | None, top_k: int = -1, top_p: float = 1.0
) -> Probe:
    """PROBE_TOKENS tokens of `prompt_ids`, sampled at PROBE_TEMPERATURE with a fixed seed and the run's
    top_k/top_p (a server started with --return-sampling-mask refuses a request without top_k), and their
    logprobs.

    The trainer scores the same tokens (compare): the label must be the new one and the mean logprob
    difference small. That also catches, at the start of a run, a server with another model, dtype, chat
    template or logprobs mode (raw logprobs differ from the tempered ones the probe asks for)."""
    params = {"max_tokens": PROBE_TOKENS, "temperature": PROBE_TEMPERATURE, "logprobs": 0, "seed": 0}
    if top_k > 0:
        params["top_k"] = top_k
    if top_p < 1:
        params["top_p"] = top_p
    body = {"model": model, "token_ids": prompt_ids, "sampling_params": params | {"ignore_eos": True}}
    with httpx.Client(headers=headers(api_key), verify=ssl_context()) as http:
        answer = post(http, url, "/inference/v1/generate", json=body)
    choice = answer["choices"][0]
    spans = choice.get("weight_versions") or []
    return Probe(
        url,
        list(choice["token_ids"]),
        [entry["logprob"] for entry in choice["logprobs"]["content"]],
        spans[-1]["version"] if spans else None,
        choice.get("sampling_mask"),
    )


def check_label(probe: Probe, label: str, when: str) -> None:
    """A UserError when the server reports other weights than `label` (one that reports none passes)."""
    if probe.label is not None and probe.label != label:
        raise UserError(
            f"the inference server {root_url(probe.url)} serves weights {probe.label!r} {when}, not {label!r}: "
            "it did not take the new weights"
        )


def compare(probe: Probe, trainer_logprobs: list[float], label: str, tolerance: float, when: str) -> float:
    """The mean |logprob difference| between a server and the trainer; ValueError past `tolerance` or when
    the server reports other weights than `label`."""
    check_label(probe, label, when)
    difference = sum(abs(a - b) for a, b in zip(probe.logprobs, trainer_logprobs)) / len(trainer_logprobs)
    if difference > tolerance:
        raise UserError(
            f"the inference server {root_url(probe.url)} disagrees with the trainer {when}: mean |logprob "
            f"difference| {difference:.3g} > inference.probe_tolerance {tolerance} on the same tokens; was it "
            "started with another model, dtype, chat template or logprobs mode (vLLM needs "
            "--logprobs-mode processed_logprobs)?"
        )
    return difference


def trainer_logprobs(
    model, autocast, prompt_ids: list[int], completion_ids: list[int], kept=None
) -> list[float]:
    """The trainer's logprobs of a probe's `completion_ids` after `prompt_ids`, at PROBE_TEMPERATURE, scored as
    training scores tokens (next_token_scores), over the kept sets `kept` (lib/head.py KeptSets, served counts
    (1, T)) when the run samples with top-k/top-p. Every rank calls it with the same tokens: under FSDP the
    forward is collective."""
    import torch

    from lib.head import next_token_scores

    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + completion_ids], device=device)  # (1, T)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, len(prompt_ids) :] = True
    with torch.no_grad(), autocast():
        positions = torch.arange(ids.shape[1], device=device)[None]
        logp, _ = next_token_scores(model, ids, positions, mask, PROBE_TEMPERATURE, kept)
    return logp[0, len(prompt_ids) :].tolist()


def probe_kept_sets(servers: "Servers", answer: Probe, prompt_length: int):
    """The kept sets the trainer scores a probe's tokens over, as training does (lib/head.py KeptSets): the
    server's (served), the trainer's own (recomputed), or None when the run samples without top-k/top-p."""
    import torch

    from lib.head import KeptSets

    if servers.kept_set == "recomputed":
        return KeptSets(top_k=servers.top_k, top_p=servers.top_p)
    if servers.kept_set != "served":
        return None
    if answer.kept is None:
        raise UserError(
            f"the inference server {root_url(answer.url)} returned no kept sets (sampling_mask): start it with "
            "--return-sampling-mask (vLLM on GPUs, or the builtin engine), or pass --kept-set recomputed"
        )
    counts = torch.zeros(1, prompt_length + len(answer.kept), dtype=torch.int32)  # (1, T)
    counts[0, prompt_length:] = torch.tensor([len(ids) for ids in answer.kept], dtype=torch.int32)
    ids = torch.tensor([i for ids in answer.kept for i in ids], dtype=torch.int32)
    return KeptSets(ids=ids, counts=counts)


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

    def reload(self, path: Path, label: str) -> None:
        """Every server loads `path` (reload_weights) under `label`, paused by this run's pause_mode."""
        reload_weights(self.urls, path, self.api_key, label, pause_mode=self.pause_mode, adapter=self.adapter)


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
) -> tuple[float, float]:
    """Writes weights/step_N (lib/checkpoint.py), has every server load it and checks that each serves it:
    its label, and the probe scored by the trainer too (every rank takes part: under FSDP the forward is
    collective). Returns the seconds it took and the largest mean |logprob difference| from the trainer.

    A server that cannot take the weights, or serves something else, stops the run with one sentence
    naming it; checkpoints stay as they were, so `--resume` continues once the server is fixed."""
    began = time.perf_counter()
    adapter = servers.adapter is not None
    path = save_weights(run_dir, step, model, tokenizer, save_dtype, keep_weights, adapter, merged)
    label, probes = f"step_{step}", []
    prompt = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    if servers.urls:
        servers.reload(path, label)
        probes = [
            probe(url, name, prompt, servers.api_key, servers.top_k, servers.top_p)
            for url, name in zip(servers.urls, servers.names)
        ]
    world_size = dist.world()[2]
    probes = dist.scatter([probes] * world_size)
    differences = []
    for answer in probes:
        kept = probe_kept_sets(servers, answer, len(prompt))
        scored = trainer_logprobs(model, autocast, prompt, answer.completion_ids, kept)
        # A token outside the trainer's recomputed kept set (a boundary the two sides round apart) has no
        # logprob there: it is left out of the comparison, as the loss leaves it out.
        scored = [t if math.isfinite(t) else s for t, s in zip(scored, answer.logprobs)]
        if servers.urls:
            differences.append(compare(answer, scored, label, servers.probe_tolerance, when))
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
        self.prompt = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-sync")
        self.pending: concurrent.futures.Future | None = None

    def start(self, step: int, path: Path) -> None:
        assert self.pending is None, "one sync at a time: wait() for the previous one first"
        self.pending = self.executor.submit(self._reload, step, path)

    def _reload(self, step: int, path: Path) -> float:
        began, label, servers = time.perf_counter(), f"step_{step}", self.servers
        servers.reload(path, label)
        for url, name in zip(servers.urls, servers.names):
            answer = probe(url, name, self.prompt, servers.api_key, servers.top_k, servers.top_p)
            check_label(answer, label, f"after step {step}")
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
        self.on_loaded, self.reloader = None, None

    def attach(self, on_loaded) -> None:
        """Rank 0: `on_loaded(N)` follows each load of step N's weights."""
        self.on_loaded = on_loaded
        if self.background:
            self.reloader = Reloader(self.servers, self.tokenizer, on_loaded)

    def merged(self, step: int) -> bool:
        """Whether step N's weights are also written merged (--save-merged, or the last step)."""
        return self.save_merged or step == self.last_step

    def publish(self, step: int, when: str) -> tuple[float, float]:
        """publish() of step N's weights: (seconds, probe difference)."""
        return publish(
            self.run_dir, step, self.model, tokenizer=self.tokenizer, save_dtype=self.save_dtype,
            autocast=self.autocast, servers=self.servers, keep_weights=self.keep_weights,
            merged=self.merged(step), when=when,
        )  # fmt: skip

    def after_step(self, step: int) -> dict[str, float]:
        """Step N's weights to the servers: published before this returns, or (background) written once reload
        N-1 is done, so one sync is in flight and pruning keeps what it reads, then reloaded beside the next
        step. Returns its time/sync_weights, time/wait_sync and sync/probe_logprob_difference."""
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
        path = save_weights(
            self.run_dir, step, self.model, self.tokenizer, self.save_dtype, self.keep_weights,
            adapter=self.servers.adapter is not None, merged=self.merged(step),
        )  # fmt: skip
        if self.reloader:
            self.reloader.start(step, path)
        # The logprob probe runs at the start only (Reloader): seconds is the last finished reload's.
        return {"time/sync_weights": seconds, "time/wait_sync": waited, "sync/probe_logprob_difference": 0.0}

    def in_flight(self) -> bool:
        return self.reloader is not None and self.reloader.in_flight()

    def wait(self) -> None:
        """Until the servers serve the last weights written (before an eval or a checkpoint)."""
        if self.reloader:
            self.reloader.wait()

    def close(self) -> None:
        """Lets a reload in flight finish (a server must not stay paused)."""
        if self.reloader:
            self.reloader.close()
