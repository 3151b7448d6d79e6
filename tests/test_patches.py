"""lib/orchestrator/patches.py: verifiers' train client takes the builtin server's /inference/v1/generate answers (vLLM's shape)."""

import asyncio

import pytest

from lib import endpoint
from lib.inference import launch

KEY = "test-key"


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("patches") / "serve.log"
    with launch.running_server(
        str(tiny_dir), engine="torch", api_key=KEY, log_path=log, threads=1
    ) as running:
        yield {"url": endpoint.root_url(running.url), "name": str(tiny_dir)}


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from lib.models.load import load_tokenizer

    return load_tokenizer(str(tiny_dir))


def test_verifiers_train_client_generates_through_the_token_route(server, tokenizer, monkeypatch):
    """The train client rejects vLLM 0.32's /inference/v1/generate answers as they come (the server answers
    in vLLM's shape); through plainrl's HTTP layer (lib/orchestrator/patches.py) it takes them, and trains on the
    prompt tokens the server echoed."""
    import renderers.client
    from verifiers.v1.clients.train import TrainClient
    from verifiers.v1.configs.client import TrainClientConfig
    from verifiers.v1.dialects.chat import ChatDialect
    from verifiers.v1.types import SamplingConfig

    from lib.orchestrator import patches

    monkeypatch.setenv("PLAINRL_TEST_API_KEY", KEY)
    config = TrainClientConfig(
        base_url=server["url"] + "/v1", api_key_var="PLAINRL_TEST_API_KEY", renderer_model_name=server["name"]
    )
    messages = [{"role": "user", "content": "Reverse: abc"}]
    body = {"model": server["name"], "messages": messages}
    echoed = []
    parse = renderers.client.parse_generate_response
    monkeypatch.setattr(
        renderers.client, "parse_generate_response", lambda raw: echoed.append(parse(raw)) or echoed[-1]
    )

    async def call():
        client = TrainClient(config)
        try:
            return await client.get_response(
                ChatDialect(), body, SamplingConfig(temperature=1.0, max_tokens=8)
            )
        finally:
            await client.close()

    patches.use_aiohttp_transport()
    with monkeypatch.context() as without_names:  # the answers as vLLM gives them, unnamed
        without_names.setattr(patches, "name_generate_tokens", lambda payload: payload)
        with pytest.raises(renderers.client.MalformedGenerateResponseError, match="token must be 'token_id:"):
            asyncio.run(call())
    response = asyncio.run(call())
    tokens = response.tokens
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokens.prompt_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert tokens.prompt_ids == echoed[-1]["prompt_token_ids"]  # asked for, and echoed, by the transport
    assert 1 <= len(tokens.completion_ids) == len(tokens.completion_logprobs) <= 8
    assert all(lp < 0 for lp in tokens.completion_logprobs) and response.finish_reason in ("stop", "length")


def test_generate_answers_get_the_token_names_the_train_client_checks():
    from lib.orchestrator.patches import name_generate_tokens

    entry = {
        "token_id": 5,
        "logprob": -1.5,
        "rank": 2,
        "top_logprobs": [{"token_id": 7, "logprob": -0.2, "rank": 1}],
    }
    payload = name_generate_tokens({"choices": [{"logprobs": {"content": [entry]}}, {"logprobs": None}]})
    named = payload["choices"][0]["logprobs"]["content"][0]
    assert named["token"] == "token_id:5" and named["top_logprobs"][0]["token"] == "token_id:7"
    assert named["token_id"] == 5 and named["rank"] == 2  # vLLM's fields stay
