"""Running inference servers over HTTP: base URLs, the key header, /health, /v1/models, the pause watch."""

import contextlib
import functools
import os
import threading
import time

import httpx

from lib.config import KEY_VARIABLE, UserError

# How often the controller checks a server's /health while it waits on it (rollouts, a reload).
HEALTH_EVERY_S = 5.0


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


@contextlib.contextmanager
def reaching(server: str, doing: str, timeout: float):
    """Turns a request's timeout or transport error inside the block into one sentence (a UserError): `server`
    ("the inference server URL") did not `doing` ("answer /health") within `timeout` seconds (frozen), or could
    not be reached (stopped). Sync and async requests alike."""
    try:
        yield
    except httpx.TimeoutException:
        raise UserError(f"{server} did not {doing} within {timeout:.0f} s (is it frozen?)") from None
    except httpx.TransportError as error:
        raise UserError(f"{server} is not reachable ({error}): did it stop?") from None


def answered(root: str, path: str, timeout: float, request) -> httpx.Response:
    """request()'s response from the server at `root`, or a one-sentence UserError when it did not answer
    `path` within `timeout` seconds (frozen) or could not be reached (stopped)."""
    with reaching(f"the inference server {root}", f"answer {path}", timeout):
        return request()


def check_servers(urls: list[str], api_key: str | None = None, timeout: float = 5.0) -> None:
    """A one-sentence ValueError for the first server that is gone (refuses connections) or stuck (does not
    answer GET /health within `timeout` seconds, as a stopped process does)."""
    for url in urls:
        root = root_url(url)
        response = answered(
            root,
            "/health",
            timeout,
            functools.partial(
                httpx.get, f"{root}/health", headers=headers(api_key), timeout=timeout, verify=ssl_context()
            ),
        )
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


def request_name(base_url: str, model: str, api_key: str | None = None) -> str:
    """The name requests for `model` (eval.py's -m) give the server at base_url: `model` when the server lists
    it or lists nothing; the name it answers to (served_model) when `model` is a local directory, as a server
    started on DIR answers to DIR as spelled then, whatever it loaded since (what it computes with is checked
    apart: lib/inference/weights/reload.py check_serves). A builtin or vLLM server that serves neither ends in
    one sentence, before any request; another endpoint's own errors say more."""
    try:
        cards = model_cards(base_url, api_key)
    except UserError:  # an endpoint need not serve /models (check_reachable asked already)
        return model
    names = [card["id"] for card in cards]
    if model in names:
        return model
    if os.path.isdir(os.path.expanduser(model)):
        return names[0]
    if cards[0].get("owned_by") in ("plainrl", "vllm"):
        raise UserError(
            f"the inference server {root_url(base_url)} answers to {', '.join(names)}, not {model} (-m): give -m "
            "that name, or the local directory it serves"
        )
    return model


def model_card(base_url: str, api_key: str | None = None) -> dict:
    """The first model of GET /v1/models (its `id`, and `max_model_len` on vLLM and the builtin engine)."""
    return model_cards(base_url, api_key)[0]


def model_cards(base_url: str, api_key: str | None = None) -> list[dict]:
    """Every model GET /v1/models lists (the served model first; then a server's LoRA adapters), at least one."""
    base_url = check_base_url(base_url)
    try:
        response = httpx.get(f"{base_url}/models", headers=headers(api_key), timeout=30, verify=ssl_context())
        response.raise_for_status()
        cards = response.json()["data"]
        if not cards or not all(isinstance(card.get("id"), str) for card in cards):
            raise LookupError("no model id")
        return cards
    except httpx.HTTPStatusError as error:
        status = error.response.status_code
        if status in (401, 403):
            raise key_refused(base_url, status) from None
        raise UserError(f"{base_url}/models answered {status}: is it an inference server?") from None
    except httpx.HTTPError as error:
        raise UserError(f"cannot reach the inference server {base_url} ({error})") from None
    except (ValueError, LookupError, TypeError, AttributeError):
        raise UserError(f"{base_url}/models does not list a model: is it an inference server?") from None


def check_reachable(base_url: str, api_key: str | None = None) -> None:
    """A one-sentence UserError when nothing answers at base_url (refused, unknown host, no answer in 30 s).
    Any other HTTP answer passes but a refused key (401, 403), which would fail every request: an endpoint
    need not serve /models, and its own errors say more."""
    base_url = check_base_url(base_url)
    try:
        response = httpx.get(f"{base_url}/models", headers=headers(api_key), timeout=30, verify=ssl_context())
    except httpx.HTTPError as error:
        raise UserError(f"cannot reach the inference server {base_url} ({error})") from None
    if response.status_code in (401, 403):
        raise key_refused(base_url, response.status_code)


def key_refused(base_url: str, status: int) -> UserError:
    """The sentence for a server that refuses the key sent (or the lack of one) on GET /models."""
    return UserError(
        f"{base_url}/models answered {status}: the API key is wrong or missing (set $PLAINRL_API_KEY to the "
        "server's), or it is no inference server"
    )


def root_url(base_url: str) -> str:
    """http://host:port/v1 -> http://host:port (where /health and the admin routes live)."""
    return base_url.rstrip("/").removesuffix("/v1")


@contextlib.contextmanager
def key_in_environment(api_key: str | None):
    """$PLAINRL_API_KEY is `api_key` inside (verifiers' clients read a key from the environment only), and what
    it was before after: a key left there would reach every server started later from this process."""
    before = os.environ.get(KEY_VARIABLE)
    if api_key:
        os.environ[KEY_VARIABLE] = api_key
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(KEY_VARIABLE, None)
        else:
            os.environ[KEY_VARIABLE] = before
