"""The builtin engine against real vLLM 0.32 (its CPU build), same weights in fp32: every route plainrl uses
answers with the same JSON keys, value types and status codes; greedy decoding picks the same tokens; and
each engine's sampled logprobs equal the other engine's for the same tokens, at several sampling settings.

The other engine scores a completion as a prompt: vLLM's `prompt_logprobs` over the whole vocabulary (the
raw distribution), and for the builtin engine, which serves no prompt_logprobs, the forward it runs
(transformers, fp32). Temperature, top-k and top-p are then applied to it as lib/inference/server/decode.py applies them, so
vLLM's sampled logprobs check that filter too.
"""

import math

import httpx
import pytest
import torch

from lib import endpoint
from lib.inference import launch

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

NAME = "policy"
PROMPTS = ["hello world", "a quick brown fox", "reinforcement", "tiny model"]


@pytest.fixture(scope="module")
def builtin_server(trained_tiny, tmp_path_factory):
    log = tmp_path_factory.mktemp("builtin") / "serve.log"
    extra = ["--model.dtype", "float32", "--max-logprobs", "128", "--served-model-name", NAME]
    with launch.running_server(str(trained_tiny), engine="torch", log_path=log, extra_args=extra) as server:
        yield server


@pytest.fixture(scope="module")
def servers(vllm_server, builtin_server, trained_tiny):
    from lib.inference.weights import reload

    # The shared vLLM server may hold another test's weights: both engines start from trained_tiny.
    reload.reload_weights([vllm_server.url], trained_tiny, None, "default")
    return {"vllm": vllm_server, "builtin": builtin_server}


def root(server) -> str:
    return endpoint.root_url(server.url)


def model_name(server) -> str:
    return endpoint.served_model(server.url)


def chat_prompt(text: str) -> list[dict]:
    system = "Reverse the text character-by-character. Put your answer in <reversed_text> tags."
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


def requests(model: str) -> dict[str, tuple[str, str, dict | bytes | None]]:
    """Every route and request shape plainrl sends, plus the bad inputs a client can send by mistake."""
    messages = chat_prompt("abc")
    return {
        "health": ("GET", "/health", None),
        "models": ("GET", "/v1/models", None),
        "chat": ("POST", "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 5}),
        "chat_logprobs": (
            "POST",
            "/v1/chat/completions",
            {"model": model, "messages": messages, "max_tokens": 5, "logprobs": True, "top_logprobs": 2}
            | {"return_token_ids": True},
        ),
        "chat_token_ids": (
            "POST",
            "/v1/chat/completions",
            {"model": model, "messages": messages, "max_tokens": 3, "logprobs": True}
            | {"return_tokens_as_token_ids": True},
        ),
        "completions": (
            "POST",
            "/v1/completions",
            {"model": model, "prompt": [5, 6, 7], "max_tokens": 4, "logprobs": 0, "return_token_ids": True},
        ),
        "completions_text": ("POST", "/v1/completions", {"model": model, "prompt": "abc", "max_tokens": 3}),
        "generate": (
            "POST",
            "/inference/v1/generate",
            {"model": model, "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4, "logprobs": 1}}
            | {"return_token_ids": True},
        ),
        "generate_plain": (
            "POST",
            "/inference/v1/generate",
            {"model": model, "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}},
        ),
        "template_kwargs_override": (
            "POST",
            "/v1/chat/completions",
            {"model": model, "messages": messages, "max_tokens": 3, "return_token_ids": True}
            | {"chat_template_kwargs": {"add_generation_prompt": False}},
        ),
        "tiny_temperature": (
            "POST",
            "/v1/completions",
            {"model": model, "prompt": [5, 6, 7], "max_tokens": 4, "logprobs": 0, "temperature": 1e-45},
        ),
        "unknown_model": ("POST", "/v1/chat/completions", {"model": "nope", "messages": messages}),
        "negative_temperature": (
            "POST",
            "/v1/chat/completions",
            {"model": model, "messages": messages, "temperature": -1},
        ),
        "broken_json": ("POST", "/v1/chat/completions", b"{"),
        "too_long": ("POST", "/v1/completions", {"model": model, "prompt": [5] * 5000, "max_tokens": 4}),
        "empty_tokens": (
            "POST",
            "/inference/v1/generate",
            {"model": model, "token_ids": [], "sampling_params": {"max_tokens": 2}},
        ),
        "bad_pause_mode": ("POST", "/pause?mode=bogus", None),
        "pause": ("POST", "/pause?mode=wait", None),
        "is_paused": ("GET", "/is_paused", None),
        "reset_prefix_cache": ("POST", "/reset_prefix_cache", None),
        "label": ("POST", "/update_weight_version", {"new_version": "label-1"}),
        "resume": ("POST", "/resume", None),
        "generate_labelled": (
            "POST",
            "/inference/v1/generate",
            {"model": model, "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}},
        ),
    }


def send(server, method: str, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        headers = {"Content-Type": "application/json"}
        return httpx.request(method, root(server) + path, content=body, headers=headers, timeout=120)
    return httpx.request(method, root(server) + path, json=body, timeout=120)


# Maps keyed by token (a completion's top_logprobs) have data for keys.
TOKEN_KEYED = {"top_logprobs"}


def shape(value, key: str = ""):
    """The JSON's keys and value types, with int and float as "number" (JSON does not tell them apart)."""
    if isinstance(value, dict):
        if key in TOKEN_KEYED:
            return {"<token>": shape(next(iter(value.values()))) if value else None}
        return {k: shape(v, k) for k, v in value.items()}
    if isinstance(value, list):
        items = [shape(v, key) for v in value if v is not None]
        return [items[0]] if items else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return type(value).__name__


def differences(vllm, builtin, path="") -> list[str]:
    """Where two shapes differ; `null` in vLLM's answer matches anything (a field it fills only sometimes)."""
    if isinstance(vllm, dict) and isinstance(builtin, dict):
        found = []
        for key in sorted(set(vllm) | set(builtin)):
            if key not in builtin:
                found.append(f"{path}.{key}: only vLLM has it")
            elif key not in vllm:
                found.append(f"{path}.{key}: only the builtin engine has it")
            else:
                found += differences(vllm[key], builtin[key], f"{path}.{key}")
        return found
    if isinstance(vllm, list) and isinstance(builtin, list):
        return differences(vllm[0], builtin[0], path + "[]") if vllm and builtin else []
    if vllm == "NoneType" or vllm == builtin:
        return []
    return [f"{path}: vLLM {vllm}, builtin {builtin}"]


def test_every_route_answers_with_vllms_keys_types_and_status_codes(servers):
    answers = {}
    for engine, server in servers.items():
        answers[engine] = {
            name: send(server, method, path, body) for name, (method, path, body) in requests(NAME).items()
        }
    found = []
    for name in requests(NAME):
        vllm, builtin = answers["vllm"][name], answers["builtin"][name]
        if vllm.status_code != builtin.status_code:
            found.append(f"{name}: status {vllm.status_code} vs {builtin.status_code} ({builtin.text[:200]})")
            continue
        if vllm.content or builtin.content:
            found += [f"{name} {d}" for d in differences(shape(vllm.json()), shape(builtin.json()))]
    assert not found, "\n".join(found)
    for engine in servers:  # the label set above is what the weights report
        labelled = answers[engine]["generate_labelled"].json()["choices"][0]
        assert labelled["weight_versions"] == [{"version": "label-1", "start": 0, "end": 2}]
    # add_generation_prompt in chat_template_kwargs gives way to the request's own (before: a 500 from the
    # builtin engine); a temperature below 0.01 is raised to 0.01 (before: NaN logprobs, then a 500).
    prompts = {engine: answers[engine]["template_kwargs_override"].json() for engine in servers}
    assert prompts["vllm"]["prompt_token_ids"] == prompts["builtin"]["prompt_token_ids"]
    for engine in servers:
        logprobs = answers[engine]["tiny_temperature"].json()["choices"][0]["logprobs"]["token_logprobs"]
        assert all(math.isfinite(x) for x in logprobs), (engine, logprobs)
    generated = answers["vllm"]["generate"].json()["choices"][0]
    assert generated["weight_versions"][0]["version"] == "default"  # labelled after it ran
    assert generated["logprobs"]["content"][0]["token_id"] == generated["token_ids"][0]


def test_greedy_decoding_picks_the_same_tokens(servers):
    for text in PROMPTS:
        token_ids = {}
        for engine, server in servers.items():
            body = {"model": NAME, "messages": chat_prompt(text), "max_tokens": 40, "temperature": 0}
            answer = send(server, "POST", "/v1/chat/completions", body | {"return_token_ids": True}).json()
            token_ids[engine] = answer["choices"][0]["token_ids"]
        assert token_ids["vllm"] == token_ids["builtin"], text
        assert len(set(token_ids["vllm"])) > 3  # a trained model: not one token over and over


def full_distribution(engine: str, servers, model_dir, token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """The raw next-token logprobs over the whole vocabulary after each prefix of `token_ids`: (T-1, V)."""
    if engine == "builtin":  # the builtin engine's forward: transformers on the same fp32 weights
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            return model(torch.tensor([token_ids])).logits[0, :-1].double().log_softmax(-1)
    server = servers[engine]
    body = {"model": NAME, "prompt": token_ids, "max_tokens": 1, "prompt_logprobs": vocab_size}
    answer = send(server, "POST", "/v1/completions", body)
    assert answer.status_code == 200, answer.text
    steps = answer.json()["choices"][0]["prompt_logprobs"][1:]
    table = torch.full((len(steps), vocab_size), float("-inf"), dtype=torch.float64)
    for row, step in enumerate(steps):
        for token, entry in step.items():
            table[row, int(token)] = entry["logprob"]
    assert torch.isfinite(table).all(), "prompt_logprobs did not cover the vocabulary"
    return table


@pytest.mark.parametrize(
    "temperature, top_p, top_k",
    [(1.0, 1.0, -1), (0.7, 1.0, -1), (0.7, 0.9, -1), (0.7, 1.0, 20), (1.0, 0.9, 20)],
)
def test_sampled_logprobs_agree_across_engines(servers, trained_tiny, temperature, top_p, top_k):
    from transformers import AutoConfig

    from lib.inference.server.sampler import processed_logprobs

    vocab_size = AutoConfig.from_pretrained(trained_tiny).vocab_size
    worst = 0.0
    for sampler, scorer in (("vllm", "builtin"), ("builtin", "vllm")):
        for seed, text in enumerate(PROMPTS):
            prompt = send(
                servers[sampler],
                "POST",
                "/v1/chat/completions",
                {"model": NAME, "messages": chat_prompt(text), "max_tokens": 1, "return_token_ids": True},
            ).json()["prompt_token_ids"]
            params = {"max_tokens": 30, "logprobs": 0, "temperature": temperature, "top_p": top_p}
            params |= {"top_k": top_k, "seed": seed}
            body = {"model": NAME, "token_ids": prompt, "sampling_params": params}
            choice = send(servers[sampler], "POST", "/inference/v1/generate", body).json()["choices"][0]
            completion = choice["token_ids"]
            sampled = torch.tensor(
                [entry["logprob"] for entry in choice["logprobs"]["content"]], dtype=torch.float64
            )
            raw = full_distribution(scorer, servers, trained_tiny, prompt + completion, vocab_size)
            raw = raw[len(prompt) - 1 :]
            rows = len(completion)
            expected = processed_logprobs(
                raw,
                torch.full((rows,), temperature, dtype=torch.float64),
                torch.full((rows,), top_k if top_k > 0 else vocab_size),
                torch.full((rows,), top_p, dtype=torch.float64),
                filtered=top_p < 1 or top_k > 0,
            ).gather(-1, torch.tensor(completion)[:, None])[:, 0]
            worst = max(worst, (sampled - expected).abs().max().item())
    assert worst < 1e-4, worst
