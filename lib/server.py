"""The builtin engine's HTTP server: vLLM's routes and JSON shapes, on FastAPI.

Generation: /v1/chat/completions, /v1/completions, /inference/v1/generate (tokens in, tokens out, as
verifiers' train client calls it through `renderers.client.generate`). Weight updates, vLLM dev-mode
style: /pause, /resume, /collective_rpc with method reload_weights, /reset_prefix_cache. Every answer
that generated carries `weight_version`; /v1/models lists it too.

Where the builtin server differs from vLLM, on purpose:
- `--api-key` guards every route, /health and the admin routes included (vLLM guards /v1 and /inference).
- /pause defaults to mode=wait (in-flight requests finish); vLLM defaults to abort, so callers that
  want the same behaviour from both should send mode=wait. mode=keep is served as wait: freezing a
  sequence across a reload would mix two policies in it.
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

from fastapi import FastAPI, Query
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from lib.engine import LOGPROB_FLOOR, Completion, Engine, SamplingParams
from lib.protocol import ChatRequest, CompletionRequest, GenerateRequest, RpcRequest
from lib.tools import parse_tool_calls


def error(status: int, message: str) -> JSONResponse:
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
        "param": None,
        "code": status,
    }
    return JSONResponse({"error": body}, status_code=status)


def usage(prompt_length: int, completions: list[Completion]) -> dict:
    generated = sum(len(c.token_ids) for c in completions)
    return {
        "prompt_tokens": prompt_length,
        "completion_tokens": generated,
        "total_tokens": prompt_length + generated,
    }


def sse(chunks: list[dict]) -> StreamingResponse:
    """A finished answer as Server-Sent Events (one chunk per choice, then [DONE]) for clients that stream."""
    lines = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks] + ["data: [DONE]\n\n"]
    return StreamingResponse(iter(lines), media_type="text/event-stream")


def build_app(engine: Engine, served_model_name: str, api_key: str | None, weights_root: Path) -> FastAPI:
    """The FastAPI app serving `engine` under `served_model_name`."""
    app = FastAPI(title="plainrl builtin engine")
    weights_root = Path(weights_root).expanduser().resolve()
    if api_key:
        expected_header = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def require_api_key(request, call_next):
            given = request.headers.get("authorization", "").encode()
            if not secrets.compare_digest(given, expected_header):
                return error(401, "missing or wrong API key: send `Authorization: Bearer KEY`.")
            return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, exc: RequestValidationError):
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or "body"
        return error(400, f"{where}: {first.get('msg', 'invalid value')}.")

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(ValueError)
    async def bad_value(request, exc: ValueError):
        return error(400, str(exc))

    @app.exception_handler(Exception)
    async def internal_error(request, exc: Exception):
        return error(500, f"internal error: {exc!r}")

    def check_model(name: str | None) -> None:
        if name and name != served_model_name:
            raise HTTPException(404, f"The model `{name}` does not exist.")

    async def generate(prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        return await asyncio.wrap_future(engine.submit(prompt_ids, params))

    def token_name(token: int, as_ids: bool) -> str:
        return f"token_id:{token}" if as_ids else engine.token_strings([token])[0]

    def chat_logprobs(completion: Completion, as_ids: bool) -> dict:
        def entry(token: int, logprob: float) -> dict:
            name = token_name(token, as_ids)
            return {"token": name, "logprob": max(logprob, LOGPROB_FLOOR), "bytes": list(name.encode())}

        content = []
        for step, (token, logprob) in enumerate(zip(completion.token_ids, completion.logprobs)):
            top = completion.top_logprobs[step] if completion.top_logprobs else []
            content.append({**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]})
        return {"content": content}

    def completion_logprobs(completion: Completion, as_ids: bool) -> dict:
        tokens = [token_name(token, as_ids) for token in completion.token_ids]
        offsets = [0, *itertools.accumulate(len(t) for t in tokens)][: len(tokens)]
        top = [{token_name(t, as_ids): lp for t, lp in step} or None for step in completion.top_logprobs]
        return {
            "tokens": tokens,
            "token_logprobs": [max(lp, LOGPROB_FLOOR) for lp in completion.logprobs],
            "top_logprobs": top or [None] * len(tokens),
            "text_offset": offsets,
        }

    # ------------------------------------------------------------ status
    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        card = {
            "id": served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "plainrl",
            "root": engine.model.name_or_path,
            "parent": None,
            "max_model_len": engine.max_model_len,
            "weight_version": engine.version,
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
                    raise ValueError("the builtin engine accepts text content parts only.")
                data["content"] = "".join(str(part.get("text", "")) for part in message.content)
            messages.append(data)
        prompt_ids = engine.render_chat(
            messages,
            tools=body.tools,
            add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
            continue_final_message=body.continue_final_message,
            **(body.chat_template_kwargs or {}),
        )
        if body.top_logprobs and not body.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true.")
        body.max_tokens = body.max_tokens or body.max_completion_tokens
        params = body.to_params(len(prompt_ids), engine.max_model_len, body.top_logprobs or 0)
        completions = await generate(prompt_ids, params)
        choices = []
        for index, completion in enumerate(completions):
            message = {"role": "assistant", "content": completion.text}
            if body.tools:  # as vLLM with a hermes tool parser: <tool_call> blocks become tool_calls
                message["content"], calls = parse_tool_calls(completion.text)
                if calls:
                    message["tool_calls"] = calls
            choice = {
                "index": index,
                "message": message,
                "logprobs": chat_logprobs(completion, body.return_tokens_as_token_ids)
                if body.logprobs
                else None,
                "finish_reason": "tool_calls" if message.get("tool_calls") else completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
            if body.return_token_ids:
                choice["token_ids"] = completion.token_ids
            choices.append(choice)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": served_model_name}
        tail = {"usage": usage(len(prompt_ids), completions), "weight_version": completions[0].weight_version}
        if body.return_token_ids:
            tail["prompt_token_ids"] = prompt_ids
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
            raise ValueError("prompt must not be empty.")
        prompts = [engine.encode(p) if isinstance(p, str) else list(p) for p in prompt]
        top = body.logprobs or 0
        params = [body.to_params(len(ids), engine.max_model_len, top) for ids in prompts]
        for ids, p in zip(prompts, params):  # refuse the whole request before any of it runs
            engine.check(ids, p)
        results = await asyncio.gather(*(generate(ids, p) for ids, p in zip(prompts, params)))
        choices = []
        for prompt_index, (ids, completions) in enumerate(zip(prompts, results)):
            for j, completion in enumerate(completions):
                choice = {
                    "index": prompt_index * (body.n or 1) + j,
                    "text": completion.text,
                    "logprobs": None,
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                    "prompt_logprobs": None,
                }
                if body.logprobs is not None:
                    choice["logprobs"] = completion_logprobs(completion, body.return_tokens_as_token_ids)
                if body.return_token_ids:
                    choice["prompt_token_ids"] = ids
                    choice["token_ids"] = completion.token_ids
                choices.append(choice)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time())}
        head["model"] = served_model_name
        all_completions = [c for completions in results for c in completions]
        total = usage(sum(len(ids) for ids in prompts), all_completions)
        if body.stream:
            chunks = [{**head, "choices": [c]} for c in choices]
            if (body.stream_options or {}).get("include_usage"):
                chunks.append({**head, "choices": [], "usage": total})
            return sse(chunks)
        return JSONResponse(
            {**head, "choices": choices, "usage": total, "weight_version": results[0][0].weight_version}
        )

    @app.post("/inference/v1/generate")
    async def generate_tokens(body: GenerateRequest):
        check_model(body.model)
        if body.features or body.content_parts:
            raise ValueError("the builtin engine serves text-only prompts (no features or content_parts).")
        if body.stream:
            raise ValueError("the builtin engine does not stream /inference/v1/generate.")
        sampling = body.sampling_params
        params = sampling.to_params(len(body.token_ids), engine.max_model_len, sampling.logprobs or 0)
        completions = await generate(body.token_ids, params)
        choices = []
        for index, completion in enumerate(completions):
            logprobs = None
            if sampling.logprobs is not None:
                logprobs = chat_logprobs(completion, as_ids=True)  # renderers' client reads "token_id:N"
            choices.append(
                {
                    "index": index,
                    "logprobs": logprobs,
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                    "token_ids": completion.token_ids,
                    "routed_experts": None,
                }
            )
        response = {
            "request_id": f"generate-tokens-{body.request_id or uuid.uuid4().hex}",
            "choices": choices,
            "usage": usage(len(body.token_ids), completions),
            "prompt_logprobs": None,
            "kv_transfer_params": None,
            "weight_version": completions[0].weight_version,
        }
        if body.return_token_ids:
            response["prompt_token_ids"] = body.token_ids
        return JSONResponse(response)

    # ------------------------------------------------------------ weight updates
    @app.post("/pause")
    async def pause(mode: Literal["wait", "keep", "abort"] = Query("wait")):
        await asyncio.to_thread(engine.pause, mode)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        engine.resume()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": engine.paused}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        return Response(status_code=200)  # the builtin engine keeps no prefix cache

    @app.post("/collective_rpc")
    async def collective_rpc(body: RpcRequest):
        if body.method != "reload_weights":
            raise ValueError(f"collective_rpc method {body.method!r} is not supported; use reload_weights.")
        weights_path = body.kwargs.get("weights_path")
        if not isinstance(weights_path, str) or not weights_path:
            raise ValueError("reload_weights needs kwargs.weights_path, a directory.")
        directory = Path(weights_path).expanduser().resolve()
        if not directory.is_relative_to(weights_root):
            raise HTTPException(403, f"weights_path must be under {weights_root}.")
        if not directory.is_dir():
            raise ValueError(f"weights_path {directory} is not a directory.")
        version = await asyncio.to_thread(engine.reload, directory)
        return {"results": [None], "weight_version": version}

    return app
