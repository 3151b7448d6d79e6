"""The builtin engine's HTTP server: vLLM's routes and JSON shapes, on FastAPI.

Generation: /v1/chat/completions, /v1/completions, /inference/v1/generate (tokens in, tokens out, as
verifiers' train client calls it through `renderers.client.generate`). Weight updates, vLLM dev-mode
style: /pause, /resume, /collective_rpc with method reload_weights, /reset_prefix_cache, and the weights'
label: /update_weight_version, /weight_info, `weight_versions` in every /inference/v1/generate choice.

Every route answers with vLLM 0.32's JSON keys and types (tests/test_vllm_differential.py holds the two
servers to it); fields for features the builtin engine lacks are null, as vLLM's are when unused.
Where the builtin server differs from vLLM, on purpose:
- `--api-key` guards every route but /health, the admin routes included (vLLM guards /v1 and
  /inference only: its admin routes are open to anyone who reaches the port).
- /pause defaults to mode=wait (in-flight requests finish); vLLM defaults to abort, so callers that
  want the same behaviour from both should send the mode. mode=keep holds in-flight requests, which
  go on under the new weights after /resume (`weight_versions` then has one span per label), as in
  vLLM; their KV is recomputed under the new weights when the pause had clear_cache (the default) or
  /reset_prefix_cache has reset_running_requests=true, as vLLM preempts and recomputes them.
- reload_weights only reads directories under the weights root; anything else is 403.
- Sampling defaults are OpenAI's (temperature 1, top_p 1, no top-k), not the model's
  generation_config.json; plainrl starts vLLM with `--generation-config vllm` to match.
- Sampling options that would change the distribution without showing in the logprobs (penalties,
  min_p, logit_bias, ...) are refused with 400 rather than ignored. Other unknown fields are ignored.
"""

import asyncio
import itertools
import json
import secrets
import time
import uuid
from pathlib import Path
from typing import Literal

from fastapi import Body, FastAPI, Query
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from lib.config import UserError
from lib.engine import LOGPROB_FLOOR, Completion, Engine, SamplingParams
from lib.protocol import ChatRequest, CompletionRequest, GenerateRequest, RpcRequest
from lib.tools import parse_tool_calls


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """vLLM's (and OpenAI's) error body, which the openai client turns into the matching exception."""
    kinds = {
        400: "BadRequestError",
        401: "AuthenticationError",
        403: "PermissionDeniedError",
        404: "NotFoundError",
    }
    body = {
        "message": message,
        "type": kinds.get(status, "InternalServerError"),
        "param": param,
        "code": status,
    }
    return JSONResponse({"error": body}, status_code=status)


# Fields of vLLM's answers that name features the builtin engine does not have (null there when unused).
UNUSED = {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def usage(prompt_length: int, completions: list[Completion]) -> dict:
    generated = sum(len(c.token_ids) for c in completions)
    return {
        "prompt_tokens": prompt_length,
        "total_tokens": prompt_length + generated,
        "completion_tokens": generated,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def sse(chunks: list[dict]) -> StreamingResponse:
    """A finished answer as Server-Sent Events (one chunk per choice, then [DONE]) for clients that stream."""
    lines = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks] + ["data: [DONE]\n\n"]
    return StreamingResponse(iter(lines), media_type="text/event-stream")


def listed_logprobs(
    completion: Completion, step: int, k: int, sampled_first_only: bool
) -> list[tuple[int, float, int]]:
    """vLLM's top-logprob list at one step: the sampled token, then the most likely ones, each token once,
    as (token, logprob, rank). Chat and /generate keep the first k entries; /v1/completions keeps the
    sampled token and k more (`sampled_first_only` False)."""
    token = completion.token_ids[step]
    entries = [(token, completion.logprobs[step], completion.ranks[step])]
    for rank, (other, logprob) in enumerate(completion.top_logprobs[step] if completion.top_logprobs else []):
        if other != token:
            entries.append((other, logprob, rank + 1))
    return entries[:k] if sampled_first_only else entries[: k + 1]


def build_app(
    engine: Engine, served_model_name: str, api_key: str | None, weights_root: Path, max_logprobs: int = 20
) -> FastAPI:
    """The FastAPI app serving `engine` under `served_model_name`."""
    app = FastAPI(title="plainrl builtin engine")
    weights_root = Path(weights_root).expanduser().resolve()
    fingerprint = f"plainrl-builtin-{secrets.token_hex(4)}"
    if api_key:
        expected_header = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def require_api_key(request, call_next):
            if request.url.path == "/health":  # open, as vLLM's: probes and load balancers have no key
                return await call_next(request)
            given = request.headers.get("authorization", "").encode()
            if not secrets.compare_digest(given, expected_header):
                return error(401, "missing or wrong API key: send `Authorization: Bearer KEY`.")
            return await call_next(request)

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

    def check_model(name: str | None) -> None:
        if name and name != served_model_name:
            raise HTTPException(404, f"The model `{name}` does not exist.")

    def check_logprobs(k: int | None, name: str) -> int:
        if k is not None and k > max_logprobs:
            raise UserError(f"{name} {k} is more than the server's max_logprobs ({max_logprobs}).")
        return k or 0

    async def generate(prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        return await asyncio.wrap_future(engine.submit(prompt_ids, params))

    def token_name(token: int, as_ids: bool) -> str:
        return f"token_id:{token}" if as_ids else engine.token_strings([token])[0]

    def chat_logprobs(completion: Completion, k: int, as_ids: bool) -> dict:
        def entry(token: int, logprob: float) -> dict:
            text = engine.token_strings([token])[0]
            name = f"token_id:{token}" if as_ids else text
            return {"token": name, "logprob": max(logprob, LOGPROB_FLOOR), "bytes": list(text.encode())}

        content = []
        for step, (token, logprob) in enumerate(zip(completion.token_ids, completion.logprobs)):
            top = listed_logprobs(completion, step, k, sampled_first_only=True)
            content.append({**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp, _ in top]})
        return {"content": content}

    def completion_logprobs(completion: Completion, k: int, as_ids: bool) -> dict:
        tokens = [token_name(token, as_ids) for token in completion.token_ids]
        offsets = [0, *itertools.accumulate(len(t) for t in tokens)][: len(tokens)]
        top = [
            {
                token_name(t, as_ids): max(lp, LOGPROB_FLOOR)
                for t, lp, _ in listed_logprobs(completion, step, k, False)
            }
            for step in range(len(tokens))
        ]
        return {
            "text_offset": offsets,
            "token_logprobs": [max(lp, LOGPROB_FLOOR) for lp in completion.logprobs],
            "tokens": tokens,
            "top_logprobs": top,
        }

    def generate_logprobs(completion: Completion, k: int) -> dict:
        def entry(token: int, logprob: float, rank: int) -> dict:
            return {"token_id": token, "logprob": max(logprob, LOGPROB_FLOOR), "rank": rank}

        content = []
        for step, (token, logprob, rank) in enumerate(
            zip(completion.token_ids, completion.logprobs, completion.ranks)
        ):
            top = listed_logprobs(completion, step, k, sampled_first_only=True)
            content.append({**entry(token, logprob, rank), "top_logprobs": [entry(*e) for e in top]})
        return {"content": content}

    def prompt_logprobs(prompt_ids: list[int], k: int) -> list[dict | None]:
        steps = engine.prompt_logprobs(prompt_ids, k)
        return [None] + [
            {
                str(token): {
                    "logprob": logprob,
                    "rank": rank,
                    "decoded_token": engine.token_strings([token])[0],
                }
                for token, logprob, rank in step
            }
            for step in steps[1:]
        ]

    # ------------------------------------------------------------ status
    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        permission = {
            "id": f"modelperm-{uuid.uuid4().hex[:16]}",
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        card = {
            "id": served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "plainrl",
            "root": engine.model.name_or_path,
            "parent": None,
            "max_model_len": engine.max_model_len,
            "permission": [permission],
        }
        return {"object": "list", "data": [card]}

    # ------------------------------------------------------------ generation
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        check_model(body.model)
        messages = []
        for message in body.messages:
            data = message.model_dump(exclude_none=True)
            if isinstance(message.content, list):
                if any(part.get("type") != "text" for part in message.content):
                    raise UserError("the builtin engine accepts text content parts only.")
                data["content"] = "".join(str(part.get("text", "")) for part in message.content)
            messages.append(data)
        prompt_ids = engine.render_chat(
            messages,
            tools=body.tools,
            add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
            continue_final_message=body.continue_final_message,
            **(body.chat_template_kwargs or {}),
        )
        if body.prompt_logprobs is not None:
            raise UserError("the builtin engine serves prompt_logprobs on /v1/completions only.")
        if body.top_logprobs and not body.logprobs:
            raise UserError("top_logprobs needs logprobs to be true.")
        top = check_logprobs(body.top_logprobs, "top_logprobs")
        body.max_tokens = body.max_tokens or body.max_completion_tokens
        params = body.to_params(len(prompt_ids), engine.max_model_len, top)
        completions = await generate(prompt_ids, params)
        choices = []
        for index, completion in enumerate(completions):
            message = {"role": "assistant", "content": completion.text}
            message.update(refusal=None, annotations=None, audio=None, function_call=None, reasoning=None)
            if body.tools:  # as vLLM with a hermes tool parser: <tool_call> blocks become tool_calls
                message["content"], calls = parse_tool_calls(completion.text)
                if calls:
                    message["tool_calls"] = calls
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": chat_logprobs(completion, top, body.return_tokens_as_token_ids)
                    if body.logprobs
                    else None,
                    "finish_reason": "tool_calls" if message.get("tool_calls") else completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                    "token_ids": completion.token_ids if body.return_token_ids else None,
                    "routed_experts": None,
                }
            )
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": served_model_name}
        tail = {
            "service_tier": None,
            "system_fingerprint": fingerprint,
            "usage": usage(len(prompt_ids), completions),
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_ids if body.return_token_ids else None,
            "prompt_text": None,
            **UNUSED,
        }
        if body.stream:
            chunks = []
            for choice in choices:
                delta = {**{k: v for k, v in choice.items() if k != "message"}, "delta": choice["message"]}
                chunks.append({**head, "object": "chat.completion.chunk", "choices": [delta]})
            if body.return_token_ids:
                chunks[0]["prompt_token_ids"] = prompt_ids
            if (body.stream_options or {}).get("include_usage"):
                chunks.append(
                    {**head, "object": "chat.completion.chunk", "choices": [], "usage": tail["usage"]}
                )
            return sse(chunks)
        return JSONResponse({**head, "object": "chat.completion", "choices": choices, **tail})

    @app.post("/v1/completions")
    async def completions_route(body: CompletionRequest):
        check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt or any(len(p) == 0 for p in prompt):
            raise UserError("prompt must not be empty.")
        prompts = [engine.encode(p) if isinstance(p, str) else list(p) for p in prompt]
        top = check_logprobs(body.logprobs, "logprobs")
        scored = check_logprobs(body.prompt_logprobs, "prompt_logprobs")
        params = [body.to_params(len(ids), engine.max_model_len, top) for ids in prompts]
        for ids, p in zip(prompts, params):  # refuse the whole request before any of it runs
            engine.check(ids, p)
        results = await asyncio.gather(*(generate(ids, p) for ids, p in zip(prompts, params)))
        choices = []
        for prompt_index, (ids, completions) in enumerate(zip(prompts, results)):
            scores = None
            if body.prompt_logprobs is not None:
                scores = await asyncio.to_thread(prompt_logprobs, ids, scored)
            for j, completion in enumerate(completions):
                choices.append(
                    {
                        "index": prompt_index * (body.n or 1) + j,
                        "text": completion.text,
                        "logprobs": completion_logprobs(completion, top, body.return_tokens_as_token_ids)
                        if body.logprobs is not None
                        else None,
                        "finish_reason": completion.finish_reason,
                        "stop_reason": completion.stop_reason,
                        "token_ids": completion.token_ids if body.return_token_ids else None,
                        "prompt_logprobs": scores,
                        "prompt_token_ids": ids if body.return_token_ids else None,
                        "routed_experts": None,
                    }
                )
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time())}
        head["model"] = served_model_name
        all_completions = [c for completions in results for c in completions]
        total = usage(sum(len(ids) for ids in prompts), all_completions)
        if body.stream:
            chunks = [{**head, "choices": [c]} for c in choices]
            if (body.stream_options or {}).get("include_usage"):
                chunks.append({**head, "choices": [], "usage": total})
            return sse(chunks)
        tail = {"service_tier": None, "system_fingerprint": fingerprint, "usage": total, **UNUSED}
        return JSONResponse({**head, "choices": choices, **tail})

    @app.post("/inference/v1/generate")
    async def generate_tokens(body: GenerateRequest):
        check_model(body.model)
        if body.features or body.content_parts:
            raise UserError("the builtin engine serves text-only prompts (no features or content_parts).")
        if body.stream:
            raise UserError("the builtin engine does not stream /inference/v1/generate.")
        sampling = body.sampling_params
        if sampling.prompt_logprobs is not None:
            raise UserError("the builtin engine serves prompt_logprobs on /v1/completions only.")
        top = check_logprobs(sampling.logprobs, "logprobs")
        params = sampling.to_params(len(body.token_ids), engine.max_model_len, top)
        completions = await generate(body.token_ids, params)
        choices = []
        for index, completion in enumerate(completions):
            choices.append(
                {
                    "index": index,
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                    "token_ids": completion.token_ids,
                    "routed_experts": None,
                    "sampling_mask": None,
                    "weight_versions": [
                        {"version": version, "start": start, "end": end}
                        for version, start, end in completion.weight_versions
                    ],
                    "logprobs": generate_logprobs(completion, top) if sampling.logprobs is not None else None,
                }
            )
        response = {
            "request_id": f"generate-tokens-{body.request_id or uuid.uuid4().hex}",
            "model": served_model_name,
            "created": int(time.time()),
            "usage": usage(len(body.token_ids), completions),
            "prompt_logprobs": None,
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": body.token_ids if body.return_token_ids else None,
            "mm_placeholders": None,
            **UNUSED,
            "output_mode": "tokens",
            "choices": choices,
        }
        return JSONResponse(response)

    # ------------------------------------------------------------ weight updates
    @app.post("/pause")
    async def pause(mode: Literal["wait", "keep", "abort"] = Query("wait"), clear_cache: bool = True):
        await asyncio.to_thread(engine.pause, mode, clear_cache)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        engine.resume()
        return {"status": "resumed"}

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

    @app.get("/weight_info")
    async def weight_info():
        return {"weight_version": engine.weight_version}

    @app.post("/collective_rpc")
    async def collective_rpc(body: RpcRequest):
        if body.method != "reload_weights":
            raise UserError(f"collective_rpc method {body.method!r} is not supported; use reload_weights.")
        weights_path = body.kwargs.get("weights_path")
        if not isinstance(weights_path, str) or not weights_path:
            raise UserError("reload_weights needs kwargs.weights_path, a directory.")
        directory = Path(weights_path).expanduser().resolve()
        if not directory.is_relative_to(weights_root):
            raise HTTPException(403, f"weights_path must be under {weights_root}.")
        if not directory.is_dir():
            raise UserError(f"weights_path {directory} is not a directory.")
        await asyncio.to_thread(engine.reload, directory)
        return {"results": [None]}

    return app
