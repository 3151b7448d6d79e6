"""What plainrl changes in the behaviour of its dependencies, each with the reason, in one place.

Each function is idempotent; lib.orchestrator.envs calls them before environments run.
"""

import asyncio
import weakref

GENERATE_PATH = "/inference/v1/generate"
# A sampling setting that travels with each generate request to the transport below, never to a server:
# the longest sequence, prompt included, that the trainer takes (seq_len).
SEQ_LEN_KEY = "plainrl_seq_len"


def name_generate_tokens(payload: dict) -> dict:
    """Gives each logprob entry of a /inference/v1/generate answer the `"token": "token_id:N"` name.

    vLLM 0.32 names the tokens of that route `{"token_id": N, "logprob": ..., "rank": ...}`; the train
    client of verifiers 0.4.0 (renderers 0.1.12) checks `entry["token"] == "token_id:N"` and rejects
    every answer without it. Both engines answer in vLLM's shape; this is the one place the client's
    expectation is met. Returns `payload`, changed in place.
    """
    for choice in payload.get("choices") or []:
        for entry in (choice.get("logprobs") or {}).get("content") or []:
            for item in [entry, *(entry.get("top_logprobs") or [])]:
                if "token" not in item and "token_id" in item:
                    item["token"] = f"token_id:{item['token_id']}"
    return payload


def fit_max_tokens(body: dict) -> dict:
    """A generate request body without SEQ_LEN_KEY, its max_tokens cut to what is left of that limit after
    the prompt (at least 1: a prompt that already fills it is left to the server and the too-long
    check). Returns `body`, changed in place."""
    sampling = body.get("sampling_params") or {}
    limit = sampling.pop(SEQ_LEN_KEY, None)
    if limit is not None:
        room = max(1, limit - len(body.get("token_ids") or []))
        sampling["max_tokens"] = min(sampling.get("max_tokens") or room, room)
    return body


def use_aiohttp_transport() -> None:
    """Makes verifiers' HTTP clients (the eval relay, the train client's /generate calls) send through aiohttp,
    and speak vLLM 0.32's dialect of /inference/v1/generate.

    httpx keeps its API (verifiers and openai use it), but its default transport, httpcore, cost about
    a third of the environment layer's CPU with 64 requests in flight (benchmarks/rl/bench_env_overhead.py).
    The transport is also the HTTP layer plainrl owns between the train client and the servers, so the
    two places where the client and vLLM disagree are settled here, for both engines alike:
    - every generate request asks for `return_token_ids`, so the answer echoes `prompt_token_ids` and
      the client trains on the prompt tokens the server actually saw, not on its own record of them;
    - every generate answer's logprob entries get the token names the client checks (`name_generate_tokens`);
    - a request that carries SEQ_LEN_KEY asks for at most what is left of it after its prompt
      (`fit_max_tokens`), so an episode ends where a training row does instead of failing with a 400
      from a server whose max_model_len is seq_len.
    """
    import json

    import aiohttp
    import httpx
    import verifiers.v1.clients.base as base
    import verifiers.v1.clients.eval as eval_client
    from httpx_aiohttp import AiohttpTransport

    class VllmDialectTransport(AiohttpTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            try:
                return await self.vllm_dialect(request)
            except httpx.TimeoutException as error:
                # httpx_aiohttp 0.2 turns every dropped connection into ConnectTimeout, which the clients
                # report as "Request timed out." and never retry; a drop is a connection error (retried).
                cause = error.__cause__
                if isinstance(cause, aiohttp.ClientConnectionError) and not isinstance(cause, TimeoutError):
                    raise httpx.RemoteProtocolError(str(cause) or "server disconnected") from cause
                raise

        async def vllm_dialect(self, request: httpx.Request) -> httpx.Response:
            if not request.url.path.endswith(GENERATE_PATH):
                return await super().handle_async_request(request)
            body = fit_max_tokens({**json.loads(request.content), "return_token_ids": True})
            headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
            request = httpx.Request(
                request.method, request.url, headers=headers, json=body, extensions=request.extensions
            )
            response = await super().handle_async_request(request)
            if response.status_code != 200:
                return response
            payload = name_generate_tokens(json.loads(await response.aread()))
            headers = {
                k: v
                for k, v in response.headers.items()
                if k.lower() not in ("content-length", "content-encoding")
            }
            return httpx.Response(200, headers=headers, json=payload, request=request)

    def session() -> aiohttp.ClientSession:
        # No connection limit (the caller's semaphore bounds them); proxies from the environment, as httpx.
        # Idle connections are let go after 2 s, before uvicorn's 5 s (both engines' servers) closes them:
        # a connection reused just as its server closes it fails its request.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
        return aiohttp.ClientSession(connector=connector, trust_env=True)

    def build_async_httpx(config) -> httpx.AsyncClient:
        # The transport opens the session at its first request, inside the event loop that sends it.
        transport = VllmDialectTransport(client=session)
        return httpx.AsyncClient(timeout=httpx.Timeout(**config.timeout.model_dump()), transport=transport)

    # The train client calls it through base (build_async_openai); the eval client imported the name.
    base.build_async_httpx = eval_client.build_async_httpx = build_async_httpx


def cache_default_factory_checks() -> None:
    """Makes pydantic remember whether a field's default_factory takes the validated data.

    pydantic 2.14 answers that with inspect.signature() on every model_construct of a model with a
    default_factory field, uncached; for builtins like `list` it parses the signature from text.
    verifiers builds several such models per turn: it was 15% of the rollout producer's CPU
    (benchmarks/rl/bench_env_overhead.py). The answer depends on the factory alone, so it is cached.
    """
    import functools

    from pydantic._internal import _fields

    check = _fields.takes_validated_data_argument
    if hasattr(check, "cached"):
        return
    cached = functools.lru_cache(maxsize=4096)(check)

    def takes_validated_data_argument(default_factory) -> bool:
        try:
            return cached(default_factory)
        except TypeError:  # an unhashable factory: ask every time, as pydantic does
            return check(default_factory)

    takes_validated_data_argument.cached = cached
    _fields.takes_validated_data_argument = takes_validated_data_argument


_lock_loop = None


def rebind_renderers_lock() -> None:
    """Gives renderers' module-level asyncio.Lock to the running event loop.

    The train client guards its first GET /v1/models per server with that lock, which binds to the
    first loop that waits on it; every train episode of a later asyncio.run (tests, a second eval in
    one process) would then fail with "bound to a different event loop".
    """
    global _lock_loop
    import renderers.client

    loop = asyncio.get_running_loop()
    if _lock_loop is None or _lock_loop() is not loop:
        renderers.client._max_prompt_len_lock = asyncio.Lock()
        _lock_loop = weakref.ref(loop)
