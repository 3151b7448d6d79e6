"""The request bodies the builtin server accepts: vLLM's field names and limits, turned into SamplingParams.

Sampling options that would change the distribution without showing in the logprobs (penalties, min_p,
logit_bias, ...) are refused rather than ignored; other unknown fields are ignored, as vLLM does.
"""

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

from lib.config import UserError
from lib.engine import SamplingParams

# Options the builtin engine does not implement, with the value that means "off".
NEUTRAL = {
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
    "logit_bias": None,
    "use_beam_search": False,
    "echo": False,
    "suffix": None,
}


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
        for name, neutral in NEUTRAL.items():
            value = getattr(self, name, None)
            if value not in (None, neutral) and value != {}:
                raise UserError(f"{name} is not supported by the builtin engine.")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if "" in stops:
            raise UserError("stop strings must not be empty.")
        return SamplingParams(
            # Like vLLM: without max_tokens, generate up to the end of the context.
            max_tokens=self.max_tokens or max(max_model_len - prompt_length, 1),
            temperature=1.0 if self.temperature is None else self.temperature,
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


class RpcRequest(BaseModel):
    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None
