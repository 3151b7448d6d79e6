"""The builtin server's wire format: vLLM's request bodies (turned into SamplingParams) and answer shapes,
and the served tokenizer."""

import itertools
import json
import threading
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

from lib.config import UserError
from lib.inference.server.decode import LOGPROB_FLOOR, Completion, SamplingParams
from lib.inference.server.tools import parse_tool_calls

# Options the builtin engine does not implement, each with the value that leaves it off. Any other value
# is refused with 400 rather than ignored: penalties, min_p, logit_bias... would change the distribution
# without showing in the logprobs. Other unknown fields are ignored, as vLLM does.
UNSUPPORTED_OPTIONS_OFF = {
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
    "logit_bias": None,
    "use_beam_search": False,
    "echo": False,
    "suffix": None,
    "prompt_logprobs": None,  # served on /v1/completions (CompletionRequest), refused elsewhere
}
# Fields of vLLM's answers for features the builtin engine does not have: null, as vLLM's are when unused.
NULL_FEATURE_FIELDS = {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


class Tokenizer:
    """The served model's tokenizer behind a lock: the HTTP side and the engine's worker thread share it,
    and fast tokenizers are not safe to share across threads."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return self.tokenizer.encode(text, add_special_tokens=False)

    def render_chat(self, messages: list[dict], **template_kwargs) -> list[int]:
        """Token ids of the chat template's rendering, encoded without extra special tokens (as vLLM does)."""
        from jinja2 import TemplateError

        with self._lock:
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
            except TemplateError as error:  # templates refuse bad conversations by raising: a user error
                raise UserError(f"the chat template rejected the messages ({error}).") from error
            return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        with self._lock:
            return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token decoded on its own (the `token` field of OpenAI logprobs)."""
        with self._lock:
            return [self.tokenizer.decode([token]) for token in token_ids]


# ------------------------------------------------------------ requests
class SamplingFields(BaseModel):
    """Sampling fields of every generation route, with vLLM's names."""

    model_config = ConfigDict(extra="ignore")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    n: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None
    use_beam_search: bool | None = None

    def to_params(self, prompt_length: int, max_model_len: int, top_logprobs: int) -> SamplingParams:
        """The engine's SamplingParams; `logprobs` limits (the server's max_logprobs) are the caller's to check."""
        scores_prompts = isinstance(self, CompletionRequest)
        for name, off in UNSUPPORTED_OPTIONS_OFF.items():
            if name == "prompt_logprobs" and scores_prompts:
                continue
            value = getattr(self, name, None)
            if value not in (None, off) and value != {}:
                raise UserError(f"{name} is not supported by the builtin engine.")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if "" in stops:
            raise UserError("stop strings must not be empty.")
        return SamplingParams(
            # Like vLLM: without max_tokens, generate up to the end of the context.
            max_tokens=self.max_tokens or max(max_model_len - prompt_length, 1),
            # vLLM 0.32 raises 0 < temperature < 0.01 to 0.01 (a smaller one overflows the logits).
            temperature=1.0 if self.temperature is None else self.temperature and max(self.temperature, 0.01),
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or -1,
            n=self.n or 1,
            seed=self.seed,
            stop=stops,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            top_logprobs=top_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            prompt_logprobs=self.prompt_logprobs if scores_prompts else None,
        )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None


class GenerateSamplingParams(SamplingFields):
    logprobs: int | None = Field(None, ge=0)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    token_ids: list[NonNegativeInt] = Field(min_length=1)
    sampling_params: GenerateSamplingParams
    model: str | None = None
    request_id: str | None = None
    stream: bool = False
    return_token_ids: bool = False
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None


class LoraRequest(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class RpcRequest(BaseModel):
    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None


# ------------------------------------------------------------ answers
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


def model_card(
    served_model_name: str, root: str, max_model_len: int, created: int, parent: str | None = None
) -> dict:
    """The served model (or a LoRA adapter on `parent`) as GET /v1/models lists it (with vLLM's `max_model_len`)."""
    return {
        "id": served_model_name,
        "object": "model",
        "created": created,
        "owned_by": "plainrl",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        # vLLM lists one model_permission object here, which nothing reads: the key stays, empty.
        "permission": [],
    }


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
    """A finished answer as Server-Sent Events (one chunk per choice, then [DONE]) for clients that stream.

    Kept though plainrl never streams: serve.py is also an OpenAI-compatible server, and the OpenAI SDKs
    and chat UIs that users point at `make serve` stream.
    """
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


def chat_messages(body: ChatRequest) -> list[dict]:
    """The conversation for the chat template: text content parts joined into one string."""
    messages = []
    for message in body.messages:
        data = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            if any(part.get("type") != "text" for part in message.content):
                raise UserError("the builtin engine accepts text content parts only.")
            data["content"] = "".join(str(part.get("text", "")) for part in message.content)
        messages.append(data)
    return messages


def chat_choice(index: int, completion: Completion, body: ChatRequest, k: int, tokenizer: Tokenizer) -> dict:
    """One choice of a /v1/chat/completions answer (`k` top logprobs per token)."""

    def entry(token: int, logprob: float) -> dict:
        text = tokenizer.token_strings([token])[0]
        name = f"token_id:{token}" if body.return_tokens_as_token_ids else text
        return {"token": name, "logprob": max(logprob, LOGPROB_FLOOR), "bytes": list(text.encode())}

    message = {"role": "assistant", "content": completion.text}
    message.update(refusal=None, annotations=None, audio=None, function_call=None, reasoning=None)
    if body.tools:  # as vLLM with a hermes tool parser: <tool_call> blocks become tool_calls
        message["content"], calls = parse_tool_calls(completion.text)
        if calls:
            message["tool_calls"] = calls
    logprobs = None
    if body.logprobs:
        content = []
        for step, (token, logprob) in enumerate(zip(completion.token_ids, completion.logprobs)):
            top = listed_logprobs(completion, step, k, sampled_first_only=True)
            content.append({**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp, _ in top]})
        logprobs = {"content": content}
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": "tool_calls" if message.get("tool_calls") else completion.finish_reason,
        "stop_reason": completion.stop_reason,
        "token_ids": completion.token_ids if body.return_token_ids else None,
        "routed_experts": None,
    }


def chat_chunks(
    head: dict, choices: list[dict], prompt_ids: list[int], body: ChatRequest, total: dict
) -> list:
    """A chat answer as stream chunks: one per choice (its message as the delta), then the usage if asked."""
    chunks = []
    for choice in choices:
        delta = {**{k: v for k, v in choice.items() if k != "message"}, "delta": choice["message"]}
        chunks.append({**head, "object": "chat.completion.chunk", "choices": [delta]})
    if body.return_token_ids:
        chunks[0]["prompt_token_ids"] = prompt_ids
    if (body.stream_options or {}).get("include_usage"):
        chunks.append({**head, "object": "chat.completion.chunk", "choices": [], "usage": total})
    return chunks


def completion_choice(
    index: int, completion: Completion, prompt_ids: list[int], body: CompletionRequest, tokenizer: Tokenizer
) -> dict:
    """One choice of a /v1/completions answer."""
    logprobs = None
    if body.logprobs is not None:
        as_ids = body.return_tokens_as_token_ids
        names = tokenizer.token_strings(completion.token_ids)
        tokens = [f"token_id:{t}" if as_ids else name for t, name in zip(completion.token_ids, names)]
        offsets = [0, *itertools.accumulate(len(t) for t in tokens)][: len(tokens)]
        top = []
        for step in range(len(tokens)):
            listed = listed_logprobs(completion, step, body.logprobs, sampled_first_only=False)
            strings = tokenizer.token_strings([t for t, _, _ in listed])
            top.append(
                {
                    f"token_id:{t}" if as_ids else name: max(lp, LOGPROB_FLOOR)
                    for (t, lp, _), name in zip(listed, strings)
                }
            )
        logprobs = {
            "text_offset": offsets,
            "token_logprobs": [max(lp, LOGPROB_FLOOR) for lp in completion.logprobs],
            "tokens": tokens,
            "top_logprobs": top,
        }
    return {
        "index": index,
        "text": completion.text,
        "logprobs": logprobs,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
        "token_ids": completion.token_ids if body.return_token_ids else None,
        "prompt_logprobs": prompt_entries(completion, prompt_ids, tokenizer),
        "prompt_token_ids": prompt_ids if body.return_token_ids else None,
        "routed_experts": None,
    }


def prompt_entries(completion: Completion, prompt_ids: list[int], tokenizer: Tokenizer) -> list | None:
    """vLLM's prompt_logprobs: None for the first prompt token, then {token id: {logprob, rank, decoded_token}}
    per token, the token itself first; -inf as LOGPROB_FLOOR (vLLM's clamp_prompt_logprobs)."""
    if completion.prompt_logprobs is None:
        return None
    entries: list[dict | None] = [None]
    for listed in completion.prompt_logprobs:
        names = tokenizer.token_strings([token for token, _, _ in listed])
        entries.append(
            {
                str(token): {"logprob": max(logprob, LOGPROB_FLOOR), "rank": rank, "decoded_token": name}
                for (token, logprob, rank), name in zip(listed, names)
            }
        )
    return entries


def generate_choice(index: int, completion: Completion, k: int | None) -> dict:
    """One choice of an /inference/v1/generate answer; `k` top logprobs per token (None: no logprobs)."""

    def entry(token: int, logprob: float, rank: int) -> dict:
        return {"token_id": token, "logprob": max(logprob, LOGPROB_FLOOR), "rank": rank}

    logprobs = None
    if k is not None:
        content = []
        for step, (token, logprob, rank) in enumerate(
            zip(completion.token_ids, completion.logprobs, completion.ranks)
        ):
            top = listed_logprobs(completion, step, k, sampled_first_only=True)
            content.append({**entry(token, logprob, rank), "top_logprobs": [entry(*e) for e in top]})
        logprobs = {"content": content}
    return {
        "index": index,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
        "token_ids": completion.token_ids,
        "routed_experts": None,
        "sampling_mask": completion.sampling_mask,
        "weight_versions": [
            {"version": version, "start": start, "end": end}
            for version, start, end in completion.weight_versions
        ],
        "logprobs": logprobs,
    }
