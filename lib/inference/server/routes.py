"""The builtin engine's HTTP routes, on FastAPI: vLLM 0.32's generation and weight-update routes.

tests/test_vllm_differential.py holds the answers to vLLM's JSON keys, types and status codes.
"""

import asyncio
import json
import secrets
import time
import uuid
from pathlib import Path
from typing import Literal

from fastapi import Body, FastAPI, Query
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from lib.config import UserError
from lib.inference.server.decode import Completion, SamplingParams
from lib.inference.server.engine import Engine
from lib.inference.server.protocol import (
    NULL_FEATURE_FIELDS,
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    LoraRequest,
    RpcRequest,
    chat_choice,
    chat_chunks,
    chat_messages,
    completion_choice,
    error,
    generate_choice,
    model_card,
    sse,
    usage,
)
from lib.inference.server.transfer import Receiver
from lib.inference.weights.fingerprint import first_difference


class RequireKey:
    """Every route but /health answers 401 without `Authorization: Bearer KEY`. Unlike vLLM, which guards /v1 and
    /inference only, the key guards the admin routes too. A plain ASGI middleware: starlette's
    BaseHTTPMiddleware (`@app.middleware`) took 0.14 ms of CPU a request, as much as the rest of a /v1/models."""

    def __init__(self, app, expected: bytes):
        self.app, self.expected = app, expected

    async def __call__(self, scope, receive, send):
        # /health stays open, as vLLM's: probes and load balancers have no key.
        if scope["type"] == "http" and scope["path"] != "/health":
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not secrets.compare_digest(given, self.expected):
                response = error(401, "missing or wrong API key: send `Authorization: Bearer KEY`.")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class QuietShutdown:
    """A request still running when the server stops (uvicorn cancels what is left after its graceful
    shutdown, serve.py's 3 s) answers 503 and ends quietly: uvicorn logged the cancellation as a 40-line
    traceback. A plain ASGI middleware, as RequireKey."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        started = False

        async def sending(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            if scope["type"] == "http" and not started:  # a stream cut in the middle just ends
                await error(503, "the server is shutting down.")(scope, receive, send)


def build_app(
    engine: Engine,
    served_model_name: str,
    api_key: str | None,
    weights_root: Path,
    max_logprobs: int = 20,
    max_lora_rank: int = 0,
    return_sampling_mask: bool = False,
) -> FastAPI:
    """The FastAPI app serving `engine` under `served_model_name` (and a LoRA adapter's name once one is
    loaded, when `max_lora_rank` > 0). `return_sampling_mask`: /inference/v1/generate returns each sampled
    token's kept ids, and, as vLLM's --return-sampling-mask, every request must sample with top_k > 0."""
    app = FastAPI(title="plainrl builtin engine")
    weights_root = Path(weights_root).expanduser().resolve()
    fingerprint = f"plainrl-builtin-{secrets.token_hex(4)}"
    adapters: dict[str, str] = {}  # loaded LoRA adapters: name -> directory
    if api_key:
        app.add_middleware(RequireKey, expected=f"Bearer {api_key}".encode())
    app.add_middleware(QuietShutdown)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, exc: RequestValidationError):
        first = exc.errors()[0]
        location = [str(part) for part in first.get("loc", ())]
        where = ".".join(location[1:]) or "body"
        return error(400, f"{where}: {first.get('msg', 'invalid value')}.", ".".join(location) or None)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        return error(exc.status_code, str(exc.detail), "model" if exc.status_code == 404 else None)

    @app.exception_handler(ValueError)
    async def bad_value(request, exc: ValueError):
        return error(400, str(exc), getattr(exc, "param", None))

    @app.exception_handler(Exception)
    async def internal_error(request, exc: Exception):
        return error(500, f"internal error: {exc!r}")

    def check_model(name: str | None) -> str:
        """The name an answer reports: the requested one (an adapter's included), else the served model's."""
        if name and name != served_model_name and name not in adapters:
            raise HTTPException(404, f"The model `{name}` does not exist.")
        return name or served_model_name

    def under_root(path: str, field: str) -> Path:
        """Only directories under the weights root load (weights_path, lora_path): a 403 otherwise."""
        directory = Path(path).expanduser().resolve()
        if not directory.is_relative_to(weights_root):
            raise HTTPException(403, f"{field} must be under {weights_root}.")
        return directory

    def check_logprobs(k: int | None, name: str) -> int:
        if k is not None and k > max_logprobs:
            raise UserError(f"{name} {k} is more than the server's max_logprobs ({max_logprobs}).")
        return k or 0

    async def generate(prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        if return_sampling_mask:  # vLLM's check, server-wide (vllm/v1/engine/input_processor.py), its words
            if params.temperature <= 0:
                raise UserError("sampling distribution replay requires temperature > 0")
            if params.top_k <= 0:
                raise UserError(
                    "sampling distribution replay requires top_k > 0 to bound sampling mask size, reduce "
                    "transfer overhead, and avoid potential OOMs"
                )
        return await asyncio.wrap_future(engine.submit(prompt_ids, params))

    # ------------------------------------------------------------ status
    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        cards = [model_card(served_model_name, engine.model.name_or_path, engine.max_model_len, created)]
        for name, directory in adapters.items():  # as vLLM lists them: root its path, parent the base
            cards.append(model_card(name, directory, engine.max_model_len, created, served_model_name))
        return {"object": "list", "data": cards}

    # ------------------------------------------------------------ generation
    # Sampling defaults are OpenAI's (temperature 1, top_p 1, no top-k), not the model's
    # generation_config.json; plainrl starts vLLM with `--generation-config vllm` to match.
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        check_model(body.model)
        # As vLLM 0.32 answers (checked against the real server): the request's own template settings win
        # over the same keys in chat_template_kwargs.
        template = {
            "tools": body.tools,
            "add_generation_prompt": body.add_generation_prompt and not body.continue_final_message,
            "continue_final_message": body.continue_final_message,
        }
        prompt_ids = engine.tokenizer.render_chat(
            chat_messages(body), **((body.chat_template_kwargs or {}) | template)
        )
        if body.top_logprobs and not body.logprobs:
            raise UserError("top_logprobs needs logprobs to be true.")
        top = check_logprobs(body.top_logprobs, "top_logprobs")
        body.max_tokens = body.max_tokens or body.max_completion_tokens
        params = body.to_params(len(prompt_ids), engine.max_model_len, top)
        completions = await generate(prompt_ids, params)
        choices = [chat_choice(i, c, body, top, engine.tokenizer) for i, c in enumerate(completions)]
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": served_model_name}
        total = usage(len(prompt_ids), completions)
        if body.stream:
            return sse(chat_chunks(head, choices, prompt_ids, body, total))
        tail = {
            "service_tier": None,
            "system_fingerprint": fingerprint,
            "usage": total,
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_ids if body.return_token_ids else None,
            "prompt_text": None,
            **NULL_FEATURE_FIELDS,
        }
        return JSONResponse({**head, "object": "chat.completion", "choices": choices, **tail})

    @app.post("/v1/completions")
    async def completions_route(body: CompletionRequest):
        model = check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt or any(len(p) == 0 for p in prompt):
            raise UserError("prompt must not be empty.")
        prompts = [engine.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
        top = check_logprobs(body.logprobs, "logprobs")
        if body.prompt_logprobs is not None:  # vLLM's checks (vllm/entrypoints/openai/completion/protocol.py)
            if body.prompt_logprobs < 0:
                raise UserError(
                    "prompt_logprobs must be >= 0 (vLLM's -1, the whole vocabulary, is not served here)."
                )
            if body.stream and body.prompt_logprobs > 0:
                raise UserError("`prompt_logprobs` are not available when `stream=True`.")
            check_logprobs(body.prompt_logprobs, "prompt_logprobs")
        params = [body.to_params(len(ids), engine.max_model_len, top) for ids in prompts]
        for ids, p in zip(prompts, params):  # refuse the whole request before any of it runs
            engine.check(ids, p)
        results = await asyncio.gather(*(generate(ids, p) for ids, p in zip(prompts, params)))
        choices = [
            completion_choice(prompt_index * (body.n or 1) + j, completion, ids, body, engine.tokenizer)
            for prompt_index, (ids, completions) in enumerate(zip(prompts, results))
            for j, completion in enumerate(completions)
        ]
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time())}
        head["model"] = model
        total = usage(sum(len(ids) for ids in prompts), [c for completions in results for c in completions])
        if body.stream:
            chunks = [{**head, "choices": [c]} for c in choices]
            if (body.stream_options or {}).get("include_usage"):
                chunks.append({**head, "choices": [], "usage": total})
            return sse(chunks)
        tail = {
            "service_tier": None,
            "system_fingerprint": fingerprint,
            "usage": total,
            **NULL_FEATURE_FIELDS,
        }
        return JSONResponse({**head, "choices": choices, **tail})

    @app.post("/inference/v1/generate")
    async def generate_tokens(body: GenerateRequest):
        model = check_model(body.model)
        if body.features or body.content_parts:
            raise UserError("the builtin engine serves text-only prompts (no features or content_parts).")
        if body.stream:
            raise UserError("the builtin engine does not stream /inference/v1/generate.")
        sampling = body.sampling_params
        top = check_logprobs(sampling.logprobs, "logprobs")
        params = sampling.to_params(len(body.token_ids), engine.max_model_len, top)
        params.sampling_mask = return_sampling_mask  # vLLM returns them on this route only
        completions = await generate(body.token_ids, params)
        k = top if sampling.logprobs is not None else None
        response = {
            "request_id": f"generate-tokens-{body.request_id or uuid.uuid4().hex}",
            "model": model,
            "created": int(time.time()),
            "usage": usage(len(body.token_ids), completions),
            "prompt_logprobs": None,
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": body.token_ids if body.return_token_ids else None,
            "mm_placeholders": None,
            **NULL_FEATURE_FIELDS,
            "output_mode": "tokens",
            "choices": [generate_choice(i, c, k) for i, c in enumerate(completions)],
        }
        return JSONResponse(response)

    # ------------------------------------------------------------ weight updates
    # mode defaults to wait (in-flight requests finish; vLLM defaults to abort, which plainrl never sends,
    # so callers send the mode); keep holds them, and they go on under the new weights after /resume.
    @app.post("/pause")
    async def pause(mode: Literal["wait", "keep"] = Query("wait"), clear_cache: bool = True):
        await asyncio.to_thread(engine.pause, mode, clear_cache)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        engine.resume()
        return {"status": "resumed"}

    # Kept: the one way to see a pause without a request that would wait on it (the tests of lib/inference/weights/sync.py's
    # failed reload read it to check the server was resumed).
    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": engine.paused}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False):
        # No KV connector here: reset_external (vLLM's external cache) has nothing to reset.
        return {"success": engine.reset_prefix_cache(reset_running_requests)}

    @app.post("/update_weight_version")
    async def update_weight_version(new_version: str = Body(embed=True)):
        engine.weight_version = new_version  # the tokens sampled from now on carry it
        return {"success": True, "new_version": new_version}

    @app.post("/collective_rpc")
    async def collective_rpc(body: RpcRequest):
        # vLLM's CPU build needs it (lib/inference/weights/vllm_worker.py); a reload here rebuilds every layer.
        if body.method == "refresh_tied_output_layer":
            return {"results": [False]}
        if (
            body.method == "weight_fingerprint"
        ):  # as lib/inference/weights/vllm_worker.py ServedWeights answers it
            served = await asyncio.to_thread(engine.weight_fingerprint)
            written = body.kwargs.get("written")
            if written is not None:
                difference = first_difference(json.loads(written), served["weights"])
                if difference is not None:
                    raise UserError(f"engine 0 computes with other weights: {difference}")
            return {"results": [served]}
        if body.method != "reload_weights":
            raise UserError(
                f"collective_rpc method {body.method!r} is not supported; use reload_weights, "
                "refresh_tied_output_layer or weight_fingerprint."
            )
        weights_path = body.kwargs.get("weights_path")
        if not isinstance(weights_path, str) or not weights_path:
            raise UserError("reload_weights needs kwargs.weights_path, a directory.")
        directory = under_root(weights_path, "weights_path")
        if not directory.is_dir():
            raise UserError(f"weights_path {directory} is not a directory.")
        await asyncio.to_thread(engine.reload, directory)
        return {"results": [None]}

    # In memory, as vLLM's weight-transfer routes (vllm/entrypoints/rl/online/api_router.py) with plainrl's
    # gloo engine: the trainer broadcasts while /update_weights receives (lib/inference/server/transfer.py).
    receiver = Receiver(engine)

    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = True):
        return {"world_size": 1}

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(init_info: dict = Body(embed=True)):
        await asyncio.to_thread(receiver.init, init_info)
        return {"message": "Weight transfer initialized"}

    @app.post("/start_weight_update")
    async def start_weight_update():
        receiver.start()
        return {"message": "Weight update started"}

    @app.post("/update_weights")
    async def update_weights(update_info: dict = Body(embed=True)):
        await asyncio.to_thread(receiver.update, update_info)
        return {"message": "Weights updated"}

    @app.post("/finish_weight_update")
    async def finish_weight_update():
        receiver.finish()
        return {"message": "Weight update finished"}

    @app.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine():
        receiver.shutdown()
        return {"message": "Weight transfer shut down"}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoraRequest):
        if not max_lora_rank:  # vLLM mounts this route only with runtime LoRA updating on
            raise HTTPException(404, "LoRA adapters are off on this server: start it with --max-lora-rank R.")
        if body.lora_name in adapters and not body.load_inplace:
            raise UserError(f"The lora adapter '{body.lora_name}' has already been loaded: set load_inplace.")
        directory = under_root(body.lora_path, "lora_path")
        if not (directory / "adapter_config.json").is_file():
            raise UserError(f"lora_path {directory} holds no adapter_config.json.")
        await asyncio.to_thread(engine.load_adapter, directory, max_lora_rank)
        adapters.clear()  # one adapter at a time (vLLM: --max-loras 1): its weights replaced the last one's
        adapters[body.lora_name] = str(directory)
        return Response(
            f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain"
        )

    return app
