"""Weight reload from the controller's side: make every server load weights/step_N (a full model, or a LoRA
adapter) under a label, and check that its engines compute with what was written (lib/inference/weights/fingerprint.py)."""

import json
import re
import threading
import time
from pathlib import Path

import httpx

from lib.config import UserError
from lib.endpoint import HEALTH_EVERY_S, answered, check_servers, headers, is_healthy, root_url, ssl_context
from lib.inference.weights import fingerprint

# /pause?mode=wait returns when the longest in-flight completion has finished (minutes for long GPU
# completions), and loading a large model takes a while too: a request may take this long, as long as
# the server keeps answering /health meanwhile. A server that dies or freezes fails that check within
# about 2 x HEALTH_EVERY_S, whatever it was doing.
REQUEST_TIMEOUT_S = 900.0


def load_refused(error: ValueError, url: str, directory: Path) -> UserError:
    """Why the server at `url` could not load `directory` (run_dir/weights/step_N, or eval.py's -m), from its
    answer, in one sentence."""
    if found := re.search(r"_path must be under (.+?)\.?\"", str(error)):  # the builtin engine's 403
        # A run's weights/step_N: every later step is written beside it, so the root must hold the run.
        wanted = directory.parents[1] if directory.parent.name == "weights" else directory
        return UserError(
            f"the inference server {root_url(url)} loads weights only from under its --weights-root {found[1]}, "
            f"and {directory} is not there: start it (scripts/serve.py) with --weights-root {wanted} or a "
            "directory above it"
        )
    return UserError(
        f"{error}; the server could not load {directory}: is {directory} visible on that server's machine? "
        "(several nodes need the run directory on a shared file system, at the same path)"
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

    def received() -> httpx.Response:
        if "error" in outcome:
            raise outcome["error"]
        return outcome["response"]

    # A daemon thread, not an executor: a request stuck on a frozen server must not hold up the exit.
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    sender.join(HEALTH_EVERY_S)
    while sender.is_alive():
        check_servers([url])
        sender.join(HEALTH_EVERY_S)
    response = answered(root, path, timeout, received)
    if response.status_code >= 400:
        raise UserError(
            f"the inference server {root} answered {path} with {response.status_code}: {response.text[:300]}"
        )
    if "json" not in response.headers.get("content-type", ""):
        return {}  # /v1/load_lora_adapter answers in plain text, on vLLM too
    return response.json()


def check_weights_dir(directory: Path, adapter: bool) -> None:
    """plainrl sends only complete weights directories it wrote (weights.save_weights renames them into
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
            raise load_refused(error, url, directory) from None
        rank = json.loads((directory / "adapter_config.json").read_text())["r"]
        raise UserError(
            f"{error}; the server could not load the LoRA adapter {directory}: start it with runtime LoRA "
            f"(scripts/serve.py --max-lora-rank {rank}; plain vLLM: --enable-lora --max-lora-rank {rank} "
            "--max-loras 1 and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), or pass --inference.lora-sync merged"
        ) from None


def refresh_tied_output_layer(http: httpx.Client, url: str) -> None:
    """After a reload of a tied model: vLLM's CPU build would go on scoring with the old output layer
    (lib/inference/weights/vllm_worker.py ServedWeights); the builtin engine and vLLM on GPUs have nothing to refresh."""
    try:
        post(http, url, "/collective_rpc", json={"method": "refresh_tied_output_layer"})
    except ValueError as error:
        raise UserError(
            f"{error}; a model whose output layer is its embedding needs vLLM started by scripts/serve.py "
            "(or with --worker-extension-cls lib.inference.weights.vllm_worker.ServedWeights), which refreshes that layer on "
            "reload"
        ) from None


def check_fingerprint(http: httpx.Client, url: str, source: str, written: dict[str, list[float]]) -> None:
    """Asks the server for the fingerprint of what its engines compute with (lib/inference/weights/fingerprint.py) and stops the
    run in one sentence naming the first weight that is not the one written (`source`: where the server took
    the weights from, in words: "it loaded from DIR", "sent to it in memory for step_N").

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
                f"the inference server {root} does not compute with the weights {source}: "
                f"in its {found[1]} the first differing weight is {found[2]}"
            ) from None
        if "weight_fingerprint" not in str(error):
            raise
        raise UserError(
            f"{error}; checking what the server computes with needs the builtin engine or vLLM started by "
            "scripts/serve.py (or with --worker-extension-cls lib.inference.weights.vllm_worker.ServedWeights)"
        ) from None
    served = answer["results"][0]
    if "unsupported" in served:  # tensor-parallel vLLM engines: not covered (docs/server.md)
        return
    if difference := fingerprint.first_difference(written, served["weights"]):
        raise UserError(
            f"the inference server {root} does not compute with the weights {source}: "
            f"in its engine {served['engine']} the first differing weight is {difference}"
        )


def check_serves(url: str, directory: Path, api_key: str | None) -> str:
    """What the server at `url` was found to compute with, against the Hugging Face directory `directory`
    (eval.py's -m), in words; a one-sentence UserError naming the first weight that differs. An endpoint that
    cannot show its weights (not plainrl's builtin engine or vLLM with lib.inference.weights.vllm_worker.ServedWeights), or a
    directory without safetensors, is not checked, and the words say why."""
    root, directory = root_url(url), Path(directory)
    if not directory.is_dir():
        return f"not checked: {directory} is no local directory (a hub id, or a name the server answers to)"
    if not (directory / "config.json").is_file() or not any(directory.glob("*.safetensors")):
        return f"not checked: {directory} holds no Hugging Face weights"
    body = {"method": "weight_fingerprint", "kwargs": {}}
    try:
        with httpx.Client(headers=headers(api_key), verify=ssl_context()) as http:
            served = post(http, url, "/collective_rpc", json=body)["results"][0]
    except (ValueError, LookupError, TypeError) as error:
        return f"not checked: {root} does not show the weights it computes with ({str(error)[:200]})"
    if "unsupported" in served:  # tensor-parallel vLLM engines (docs/server.md)
        return f"not checked: {served['unsupported']}"
    written = fingerprint.of_directory(directory, served["dtype"])
    if difference := fingerprint.first_difference(written, served["weights"]):
        raise UserError(
            f"the inference server {root} does not compute with the weights in {directory} (-m): its first "
            f"differing weight is {difference}; another run may have loaded its own weights since it started: "
            "restart the server on -m, evaluate without -b (eval.py then starts a server on -m), or pass "
            "--reload-weights to load -m into it"
        )
    return f"the weights in {directory}: every weight's fingerprint, in {served['dtype']}"


def after_load(
    http: httpx.Client, url: str, source: str, written: dict | None, label: str, tied: bool
) -> None:
    """What follows new weights into a paused server (from `source`, in words: "it loaded from DIR"): a tied
    output layer refreshed, the fingerprint checked against `written` (None: not checked), the label set,
    the KV the old weights computed dropped."""
    if tied:
        refresh_tied_output_layer(http, url)
    if written is not None:
        check_fingerprint(http, url, source, written)
    # vLLM 0.32 reports the label in every /inference/v1/generate choice as `weight_versions`, one span per
    # label; the builtin engine does the same.
    post(http, url, "/update_weight_version", json={"new_version": label})
    # KV that old weights computed must not survive (vLLM keys an adapter's prefix cache by its name, which
    # stays the same from step to step). vLLM keeps prefix-cached blocks that held requests still use, so a
    # plain /reset_prefix_cache answers success false and drops nothing; reset_running_requests=true preempts
    # the held requests, which recompute their prompt and tokens so far under the new weights.
    reset = post(http, url, "/reset_prefix_cache?reset_running_requests=true")
    if not reset.get("success"):
        raise UserError(
            f"the inference server {root_url(url)} did not drop its cached KV after the weights {source} "
            f"(/reset_prefix_cache answered {reset}): requests would reuse KV of the old weights"
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
                        raise load_refused(error, url, directory) from None
                after_load(http, url, f"it loaded from {directory}", written, label, tied)
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
