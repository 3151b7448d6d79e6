"""A test server that always answers correctly: it looks the conversation up among a taskset's reference answers.

Speaks the subset of the inference dialect the environments use (chat completions for the eval
client, /inference/v1/generate for the train client), on a free loopback port, in a thread.
"""

import contextlib
import json
import re
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from lib.inference.launch import free_port


def oracle_app(
    conversations: list,
    tokenizer=None,
    broken: bool = False,
    cut_turns: tuple = (),
    kept_sets: bool = False,
    kept_set_gaps: tuple = (),
) -> FastAPI:
    """Answers turn k of a conversation with its k-th reference reply, found by the first user message.

    A conversation is a list of messages or {"messages", "tools"}; a reference reply with tool_calls is
    answered as a tool call (OpenAI tool_calls on chat completions, the chat template's <tool_call>
    text on /generate). With `broken`, every answer is an HTTP 500 (to test that failures are counted,
    not raised). On /generate, the turns (0, 1, ...) in `cut_turns` end as a token limit cuts them: the
    reply's first 3 tokens, no end token, finish reason length. With `kept_sets`, /generate returns each
    token's kept set (`sampling_mask`, the token alone), one row short on the turns in `kept_set_gaps`.
    """
    replies = {}
    for conversation in conversations:
        messages = conversation["messages"] if isinstance(conversation, dict) else conversation
        first_user = next(m["content"] for m in messages if m["role"] == "user")
        replies[first_user] = [m for m in messages if m["role"] == "assistant"]
    app = FastAPI()
    app.state.requests = []

    def reply(messages: list[dict]) -> dict:
        first_user = next(m["content"] for m in messages if m["role"] == "user")
        return replies[first_user][sum(m["role"] == "assistant" for m in messages)]

    def answer(messages: list[dict]) -> str:
        return reply(messages)["content"]

    def wire_calls(message: dict) -> list[dict]:
        return [
            {**call, "function": {**call["function"], "arguments": json.dumps(call["function"]["arguments"])}}
            for call in message["tool_calls"]
        ]

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": "oracle", "object": "model", "created": 0, "owned_by": "test"}],
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        app.state.requests.append(body)
        if broken:
            return JSONResponse(
                {"error": {"message": "oracle is broken", "type": "server_error"}}, status_code=500
            )
        message = reply(body["messages"])
        content = message["content"]
        wire = {"role": "assistant", "content": content}
        if message.get("tool_calls") and body.get("tools"):
            wire["tool_calls"] = wire_calls(message)
        return {
            "id": "chatcmpl-oracle",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": wire,
                    "finish_reason": "tool_calls" if "tool_calls" in wire else "stop",
                }
            ],
            "usage": {
                "prompt_tokens": 1,
                "completion_tokens": len(content),
                "total_tokens": 1 + len(content),
            },
        }

    @app.post("/inference/v1/generate")
    async def generate(request: Request):
        body = await request.json()
        app.state.requests.append(body)
        # The char-level template: <|im_start|>role\ncontent<|im_end|>\n per message (tools in the first).
        text = tokenizer.decode(body["token_ids"])
        messages = [
            {"role": role, "content": content}
            for role, content in re.findall(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>", text, re.DOTALL)
        ]
        # The reply as the chat template writes an assistant turn (tool calls included), minus its frame.
        rendered = tokenizer.apply_chat_template([reply(messages)], tokenize=False)
        completion = rendered.removeprefix("<|im_start|>assistant\n").removesuffix("<|im_end|>\n")
        ids = tokenizer.encode(completion, add_special_tokens=False) + [tokenizer.eos_token_id]
        cut = sum(m["role"] == "assistant" for m in messages) in cut_turns
        ids = ids[:3] if cut else ids
        logprobs = [{"token": f"token_id:{i}", "logprob": -0.25} for i in ids]
        finish = "length" if cut else "stop"
        choice = {"index": 0, "token_ids": ids, "logprobs": {"content": logprobs}, "finish_reason": finish}
        if kept_sets:
            gap = sum(m["role"] == "assistant" for m in messages) in kept_set_gaps
            choice["sampling_mask"] = [[i] for i in ids][: len(ids) - gap]
        return {"choices": [choice]}

    return app


@contextlib.contextmanager
def serve(app: FastAPI):
    """Runs `app` on a free loopback port in a thread; yields its /v1 base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
