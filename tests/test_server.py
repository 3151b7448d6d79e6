"""The builtin server over real HTTP on the tiny model (lib/inference/server/routes.py, lib/inference/server/protocol.py): vLLM's routes and
shapes, the OpenAI and verifiers clients, sampling semantics, logprobs, reload, bad input."""

import asyncio
import shutil

import httpx
import pytest
import torch
from conftest import until_decoding

from lib import endpoint
from lib.inference import launch

KEY = "test-key"


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    """serve.py --engine auto on the tiny model, once for the module; weights_root holds step_0 (the same weights)."""
    root = tmp_path_factory.mktemp("weights_root")
    shutil.copytree(tiny_dir, root / "step_0")
    log = root.parent / "serve.log"
    # One torch thread: the tiny model gains nothing from more, and two processes each spinning two OpenMP
    # threads on a 2-core machine (this one and the server) can slow both down many times over.
    with launch.running_server(
        str(tiny_dir),
        engine="auto",
        api_key=KEY,
        weights_root=root,
        log_path=log,
        extra_args=["--max-batch-size", "32"],
        threads=1,
    ) as running:
        url = endpoint.root_url(running.url)
        client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        yield {"url": url, "client": client, "tiny_dir": tiny_dir, "root": root, "name": str(tiny_dir)}
        client.close()
    assert "engine: torch (auto:" in log.read_text()


@pytest.fixture(scope="module")
def new_weights(server):
    """Other weights (another seed) in Hugging Face format under the weights root."""
    from lib.models.tiny import TinyConfig, write_tiny

    return write_tiny(server["root"] / "step_1", TinyConfig(seed=1))


def weight_version(server) -> str:
    """The label of the weights the server samples with now (what plainrl's probe reads)."""
    body = generate_body([5, 6], max_tokens=1, ignore_eos=True)
    return answer_version(server["client"].post("/inference/v1/generate", json=body).json())


def answer_version(answer: dict) -> str:
    """The label of the weights that produced a /inference/v1/generate answer's first choice."""
    (span,) = answer["choices"][0]["weight_versions"]
    return span["version"]


def reload(server, directory, label: str | None = None) -> httpx.Response:
    """pause, reload_weights, label the new weights (if `label`), resume: the answer of reload_weights."""
    client = server["client"]
    assert client.post("/pause").status_code == 200
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(directory)}}
    answer = client.post("/collective_rpc", json=rpc)
    if label is not None:
        labelled = client.post("/update_weight_version", json={"new_version": label})
        assert labelled.json() == {"success": True, "new_version": label}
    assert client.post("/resume").status_code == 200
    return answer


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from lib.models.load import load_tokenizer

    return load_tokenizer(str(tiny_dir))


def reference_model(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def training_logprobs(model, prompt_ids, completion_ids, temperature):
    """What the trainer computes for the completion tokens (lib/trainer/loss.py), fp32 on CPU."""
    from lib.trainer.loss import token_logp

    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        return token_logp(model(ids).logits, ids, temperature)[0, len(prompt_ids) :]


def generate_body(token_ids, **sampling):
    return {"model": None, "token_ids": token_ids, "sampling_params": {"logprobs": 0, **sampling}}


async def post_all(url, requests, staggered=False):
    """Sends (path, body) pairs at once (`staggered`: the others once the first one decodes);
    returns the answers in order."""
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
    ) as client:
        first = asyncio.create_task(client.post(requests[0][0], json=requests[0][1]))
        if staggered:
            await asyncio.to_thread(until_decoding, url, {"Authorization": f"Bearer {KEY}"})
        responses = await asyncio.gather(
            first, *(client.post(path, json=body) for path, body in requests[1:])
        )
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    return [r.json() for r in responses]


def served_logprobs(choice):
    return torch.tensor([entry["logprob"] for entry in choice["logprobs"]["content"]])


# ------------------------------------------------------------ routes and auth
def test_models_route_reports_name_and_context_and_generate_the_weights_label(server):
    card = server["client"].get("/v1/models").json()["data"][0]
    assert card["id"] == server["name"] and card["object"] == "model" and card["max_model_len"] == 2048
    assert weight_version(server) == "default"


def test_every_route_but_health_requires_the_api_key(server):
    assert httpx.get(server["url"] + "/health").status_code == 200  # open, as vLLM's (probes have no key)
    routes = [
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
    ]
    routes += [
        ("POST", "/inference/v1/generate"),
        ("POST", "/pause"),
        ("POST", "/resume"),
        ("GET", "/is_paused"),
    ]
    routes += [("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache"), ("GET", "/no/such/route")]
    routes += [("POST", "/update_weight_version")]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in routes:
            response = httpx.request(method, server["url"] + path, headers=headers, json={})
            assert response.status_code == 401, (method, path, response.text)
            assert response.json()["error"]["code"] == 401
    assert server["client"].get("/is_paused").json() == {
        "is_paused": False
    }  # the unauthenticated /pause did nothing


def test_admin_routes_answer_like_vllm(server):
    client = server["client"]
    assert client.post("/reset_prefix_cache").status_code == 200
    assert client.post("/pause", params={"mode": "wait"}).json() == {"status": "paused"}
    assert client.get("/is_paused").json() == {"is_paused": True}
    assert client.post("/resume").json() == {"status": "resumed"}
    assert client.get("/is_paused").json() == {"is_paused": False}


# ------------------------------------------------------------ OpenAI client contract
def test_openai_chat_logprobs_and_token_ids_are_consistent(server, tokenizer):
    from openai import OpenAI

    client = OpenAI(base_url=server["url"] + "/v1", api_key=KEY)
    messages = [{"role": "user", "content": "Reverse: hello"}]
    response = client.chat.completions.create(
        model=server["name"],
        messages=messages,
        max_tokens=12,
        logprobs=True,
        top_logprobs=3,
        seed=1,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = response.choices[0]
    token_ids = choice.model_extra["token_ids"]
    expected_prompt = tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    assert response.model_extra["prompt_token_ids"] == expected_prompt
    assert len(token_ids) == 12 and choice.finish_reason == "length"
    assert choice.message.content == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert response.usage.prompt_tokens == len(expected_prompt) and response.usage.completion_tokens == 12
    assert [entry.token for entry in choice.logprobs.content] == [tokenizer.decode([t]) for t in token_ids]
    for entry in choice.logprobs.content:
        # vLLM's list: the sampled token first, then the most likely others.
        top = [candidate.logprob for candidate in entry.top_logprobs]
        assert len(top) == 3 and top[0] == entry.logprob and top[1:] == sorted(top[1:], reverse=True)
        assert entry.top_logprobs[0].token == entry.token and max(top) <= 0


def test_openai_completions_take_token_prompts_and_n(server, tokenizer):
    from openai import OpenAI

    client = OpenAI(base_url=server["url"] + "/v1", api_key=KEY)
    prompt_ids = tokenizer.encode("abc")
    response = client.completions.create(
        model=server["name"],
        prompt=prompt_ids,
        n=3,
        max_tokens=6,
        logprobs=0,
        extra_body={"return_token_ids": True},
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    for choice in response.choices:
        assert choice.model_extra["prompt_token_ids"] == prompt_ids
        assert len(choice.logprobs.token_logprobs) == len(choice.model_extra["token_ids"]) <= 6
        assert choice.text == tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=True)
    two = client.completions.create(model=server["name"], prompt=["ab", "cd"], n=2, max_tokens=3)
    assert [c.index for c in two.choices] == [0, 1, 2, 3] and two.usage.prompt_tokens == 4


def test_streaming_chat_through_the_openai_client(server):
    from openai import OpenAI

    client = OpenAI(base_url=server["url"] + "/v1", api_key=KEY)
    kwargs = {
        "model": server["name"],
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "seed": 4,
    }
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == [whole.finish_reason]
    assert chunks[-1].usage.completion_tokens >= 1


# ------------------------------------------------------------ sampling semantics
def test_stop_strings_and_stop_token_ids(server, tokenizer):
    client = server["client"]
    prompt = tokenizer.encode("stop test")
    greedy = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
    reference = client.post("/inference/v1/generate", json=generate_body(prompt, **greedy)).json()["choices"][
        0
    ]
    tokens = reference["token_ids"]
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    stop = text[4:6]
    cut = text.index(stop)

    def chat(**extra):
        body = {"messages": [{"role": "user", "content": "x"}], "return_token_ids": True, **extra}
        return client.post("/v1/chat/completions", json=body).json()["choices"][0]

    completions = client.post("/v1/completions", json={"prompt": prompt, **greedy, "stop": [stop]}).json()
    choice = completions["choices"][0]
    assert (
        choice["text"] == text[:cut] and choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    )
    kept = {"prompt": prompt, **greedy, "stop": stop, "include_stop_str_in_output": True}
    assert client.post("/v1/completions", json=kept).json()["choices"][0]["text"] == text[: cut + len(stop)]

    stopped = client.post(
        "/inference/v1/generate", json=generate_body(prompt, **greedy, stop_token_ids=[tokens[2]])
    )
    choice = stopped.json()["choices"][0]
    first = tokens.index(tokens[2])
    assert choice["token_ids"] == tokens[: first + 1]  # the stop token is kept, as in vLLM
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == tokens[2]
    assert chat(max_tokens=3, ignore_eos=True)["finish_reason"] == "length"


def test_seeds_reproduce_under_concurrency_and_n_gives_distinct_samples(server, tokenizer):
    prompt = tokenizer.encode("seeded")
    seeded = ("/inference/v1/generate", generate_body(prompt, n=4, seed=7, max_tokens=20, ignore_eos=True))
    noise = [
        ("/inference/v1/generate", generate_body(tokenizer.encode("x" * i), max_tokens=25))
        for i in range(1, 7)
    ]
    alone = asyncio.run(post_all(server["url"], [seeded]))[0]
    crowded = asyncio.run(post_all(server["url"], noise[:3] + [seeded] + noise[3:]))[3]
    samples = [choice["token_ids"] for choice in alone["choices"]]
    assert samples == [choice["token_ids"] for choice in crowded["choices"]]
    assert len({tuple(s) for s in samples}) == 4
    reseeded = (seeded[0], {**seeded[1], "sampling_params": {**seeded[1]["sampling_params"], "seed": 100}})
    other = asyncio.run(post_all(server["url"], [reseeded]))[0]
    assert [c["token_ids"] for c in other["choices"]] != samples


def test_logprobs_equal_the_training_logprobs(server, tokenizer):
    """Exact under batching: a long request runs first, the others join it mid-way with other prompt
    lengths (left padding, merged caches) and leave at different steps."""
    model = reference_model(server["tiny_dir"])
    texts = ["a much longer prompt than the others", "a", "reverse this", "xyz " * 12]
    prompts = [tokenizer.encode(text) for text in texts]
    worst = 0.0
    for temperature in (1.0, 0.7):
        requests = [
            (
                "/inference/v1/generate",
                generate_body(p, temperature=temperature, n=2, max_tokens=8 + 8 * i, seed=i),
            )
            for i, p in enumerate(prompts)
        ]
        requests[0][1]["sampling_params"].update(max_tokens=150, ignore_eos=True)
        for prompt, answer in zip(prompts, asyncio.run(post_all(server["url"], requests, staggered=True))):
            for choice in answer["choices"]:
                expected = training_logprobs(model, prompt, choice["token_ids"], temperature)
                worst = max(worst, (served_logprobs(choice) - expected).abs().max().item())
    assert worst < 1e-4, worst


def test_greedy_reports_the_plain_softmax_and_top_k_one_is_certain(server, tokenizer):
    model = reference_model(server["tiny_dir"])
    prompt = tokenizer.encode("greedy")
    body = generate_body(prompt, temperature=0, max_tokens=10, ignore_eos=True)
    greedy = server["client"].post("/inference/v1/generate", json=body).json()["choices"][0]
    ids = torch.tensor([prompt + greedy["token_ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    assert greedy["token_ids"] == logits.argmax(-1).tolist()
    plain = torch.log_softmax(logits, -1).gather(-1, torch.tensor(greedy["token_ids"])[:, None]).squeeze(-1)
    assert (served_logprobs(greedy) - plain).abs().max() < 1e-4
    body = generate_body(prompt, temperature=0.9, top_k=1, max_tokens=10, ignore_eos=True)
    top_one = server["client"].post("/inference/v1/generate", json=body).json()["choices"][0]
    assert top_one["token_ids"] == greedy["token_ids"] and served_logprobs(top_one).abs().max() == 0


# ------------------------------------------------------------ verifiers clients
def test_verifiers_eval_client_plain_and_streamed(server, monkeypatch):
    from verifiers.v1.clients.eval import EvalClient
    from verifiers.v1.configs.client import EvalClientConfig
    from verifiers.v1.dialects.chat import ChatDialect
    from verifiers.v1.types import SamplingConfig

    monkeypatch.setenv("PLAINRL_TEST_API_KEY", KEY)
    dialect = ChatDialect()
    native = {
        "model": "harness-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 64,
    }
    body = dialect.apply_overrides(
        native, server["name"], SamplingConfig(temperature=0.5, max_tokens=6, seed=3)
    )

    async def call():
        client = EvalClient(
            EvalClientConfig(base_url=server["url"] + "/v1", api_key_var="PLAINRL_TEST_API_KEY")
        )
        try:
            plain = await client.get_response(dialect, body, SamplingConfig())
            reply = await client.relay(dialect, {**body, "stream": True})
            parser = dialect.stream_parser()
            async for chunk in reply.chunks:
                parser.feed(chunk)
            await reply.close()
            return plain, parser.finish()
        finally:
            await client.close()

    plain, streamed = asyncio.run(call())
    assert plain.usage.completion_tokens <= 6 and plain.finish_reason in ("stop", "length")
    assert streamed.message.content == plain.message.content  # same seed, same answer


# ------------------------------------------------------------ bad input
def test_malformed_requests_get_4xx_and_the_server_stays_up(server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    gen = generate_body([5, 6], max_tokens=4)
    bad = [
        ("POST", "/v1/chat/completions", b"{not json"),
        ("POST", "/v1/chat/completions", []),
        ("POST", "/v1/chat/completions", {"max_tokens": 4}),
        ("POST", "/v1/chat/completions", {**chat, "messages": []}),
        ("POST", "/v1/chat/completions", {**chat, "messages": "hello"}),
        ("POST", "/v1/chat/completions", {**chat, "messages": [{"content": "no role"}]}),
        ("POST", "/v1/chat/completions", {**chat, "max_tokens": -1}),
        ("POST", "/v1/chat/completions", {**chat, "max_tokens": "many"}),
        ("POST", "/v1/chat/completions", {**chat, "max_tokens": 10**6}),
        ("POST", "/v1/chat/completions", {**chat, "temperature": -0.5}),
        ("POST", "/v1/chat/completions", {**chat, "top_p": 0}),
        ("POST", "/v1/chat/completions", {**chat, "top_p": 1.5}),
        ("POST", "/v1/chat/completions", {**chat, "n": 0}),
        ("POST", "/v1/chat/completions", {**chat, "n": 1000}),
        ("POST", "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 50}),
        ("POST", "/v1/chat/completions", {**chat, "top_logprobs": 2}),
        ("POST", "/v1/chat/completions", {**chat, "stop": 5}),
        ("POST", "/v1/chat/completions", {**chat, "stop": [""]}),
        ("POST", "/v1/chat/completions", {**chat, "seed": "x"}),
        ("POST", "/v1/chat/completions", {**chat, "model": "no-such-model"}),
        ("POST", "/v1/chat/completions", {**chat, "presence_penalty": 0.5}),
        ("POST", "/v1/chat/completions", {**chat, "logit_bias": {"5": 10}}),
        (
            "POST",
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        ),
        ("POST", "/v1/completions", {"prompt": [], "max_tokens": 4}),
        ("POST", "/v1/completions", {"prompt": [[]], "max_tokens": 4}),
        ("POST", "/v1/completions", {"prompt": [10**9], "max_tokens": 4}),
        ("POST", "/v1/completions", {"prompt": [-1], "max_tokens": 4}),
        ("POST", "/v1/completions", {"prompt": "a" * 5000, "max_tokens": 4}),
        ("POST", "/v1/completions", {"prompt": "a", "max_tokens": 4, "logprobs": -1}),
        ("POST", "/v1/completions", {"prompt": "a", "max_tokens": 4, "echo": True}),
        ("POST", "/inference/v1/generate", {"sampling_params": {"max_tokens": 4}}),
        ("POST", "/inference/v1/generate", {"token_ids": [5]}),
        ("POST", "/inference/v1/generate", {**gen, "token_ids": "abc"}),
        ("POST", "/inference/v1/generate", {**gen, "token_ids": []}),
        ("POST", "/inference/v1/generate", {**gen, "sampling_params": {"max_tokens": 0}}),
        ("POST", "/inference/v1/generate", {**gen, "stream": True}),
        ("POST", "/inference/v1/generate", {**gen, "features": {"mm_hashes": {}}}),
        ("POST", "/collective_rpc", {"method": "run_python", "kwargs": {}}),
        ("POST", "/collective_rpc", {"method": "reload_weights"}),
        ("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": 5}}),
        ("POST", "/pause?mode=later", None),
        ("GET", "/v1/chat/completions", None),
        ("POST", "/v1/no/such/route", chat),
    ]
    client = server["client"]
    for method, path, body in bad:
        if isinstance(body, bytes):
            response = client.request(
                method, path, content=body, headers={"Content-Type": "application/json"}
            )
        else:
            response = client.request(method, path, json=body)
        assert 400 <= response.status_code < 500, (path, body, response.status_code, response.text)
        assert response.json()["error"]["message"], response.text
    assert len(bad) >= 20
    # sync.py calls this after reloading a tied model (vLLM's CPU build needs it); a reload here rebuilds it all.
    refresh = client.post("/collective_rpc", json={"method": "refresh_tied_output_layer"})
    assert refresh.status_code == 200 and refresh.json() == {"results": [False]}, refresh.text
    assert client.get("/health").status_code == 200
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert client.get("/is_paused").json() == {"is_paused": False}


# ------------------------------------------------------------ weight reload (last: it changes the weights)
def test_reload_changes_outputs_and_version_then_restores(server, new_weights, tokenizer):
    client, version = server["client"], weight_version(server)
    body = generate_body(tokenizer.encode("policy"), seed=5, max_tokens=12, ignore_eos=True)
    before = client.post("/inference/v1/generate", json=body).json()
    assert answer_version(before) == version
    assert reload(server, new_weights, "new").json() == {"results": [None]}
    after = client.post("/inference/v1/generate", json=body).json()
    assert answer_version(after) == weight_version(server) == "new"
    assert after["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]
    assert not torch.allclose(served_logprobs(after["choices"][0]), served_logprobs(before["choices"][0]))
    assert reload(server, server["root"] / "step_0", "restored").status_code == 200
    restored = client.post("/inference/v1/generate", json=body).json()
    assert answer_version(restored) == "restored"
    for key in ("token_ids", "logprobs"):
        assert restored["choices"][0][key] == before["choices"][0][key]


def test_reload_refuses_paths_outside_the_weights_root(server):
    client, root = server["client"], server["root"]
    body = generate_body([5, 6, 7], seed=2, max_tokens=8, ignore_eos=True)
    before = client.post("/inference/v1/generate", json=body).json()["choices"][0]
    (root / "escape").symlink_to(server["tiny_dir"], target_is_directory=True)
    outside = [server["tiny_dir"], root / ".." / root.name / "..", root / "escape", "/etc"]
    for path in outside:
        response = client.post(
            "/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
        )
        assert response.status_code == 403, (path, response.text)
    missing = client.post(
        "/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(root / "nope")}}
    )
    assert missing.status_code == 400
    (root / "empty").mkdir()
    empty = client.post(
        "/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(root / "empty")}}
    )
    assert empty.status_code == 400 and "safetensors" in empty.json()["error"]["message"]
    after = client.post("/inference/v1/generate", json=body).json()["choices"][0]
    assert (
        after["token_ids"] == before["token_ids"] and after["logprobs"] == before["logprobs"]
    )  # nothing loaded


def test_reload_under_load_loses_no_request_and_never_mixes_weights(server, new_weights, tokenizer):
    client, root, url, version = server["client"], server["root"], server["url"], weight_version(server)
    models = {version: reference_model(root / "step_0"), "loaded": reference_model(new_weights)}
    prompts = [tokenizer.encode("load " * (i % 5 + 1)) for i in range(20)]
    bodies = [
        generate_body(p, max_tokens=30, temperature=0.8, seed=i, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]

    async def scenario():
        async with httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
        ) as http:
            early = [asyncio.create_task(http.post("/inference/v1/generate", json=b)) for b in bodies[:10]]
            await asyncio.to_thread(until_decoding, url, {"Authorization": f"Bearer {KEY}"})
            assert (await http.post("/pause")).status_code == 200
            held = [asyncio.create_task(http.post("/inference/v1/generate", json=b)) for b in bodies[10:]]
            await asyncio.sleep(0.3)
            assert not any(task.done() for task in held)  # paused: new requests wait
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(new_weights)}}
            assert (await http.post("/collective_rpc", json=rpc)).status_code == 200
            assert (
                await http.post("/update_weight_version", json={"new_version": "loaded"})
            ).status_code == 200
            assert (await http.post("/resume")).status_code == 200
            return [r for r in await asyncio.gather(*early, *held)]

    try:
        responses = asyncio.run(scenario())
    finally:
        client.post("/resume")
        reload(server, root / "step_0", version)
    assert [r.status_code for r in responses] == [200] * 20
    answers = [r.json() for r in responses]
    assert {answer_version(a) for a in answers[10:]} == {"loaded"}  # held through the reload: new weights
    worst = 0.0
    for prompt, answer in zip(prompts, answers):
        choice = answer["choices"][0]
        assert len(choice["token_ids"]) == 30
        expected = training_logprobs(models[answer_version(answer)], prompt, choice["token_ids"], 0.8)
        worst = max(worst, (served_logprobs(choice) - expected).abs().max().item())
    assert worst < 1e-4, worst  # every token of every sequence came from the weights it reports
