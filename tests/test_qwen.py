"""Qwen-shaped models: Qwen's token ids, the Qwen3 template against renderers' qwen3, SFT and RL tokens, the writer."""

import asyncio
import json

import pytest
import torch
from conftest import load_script
from renderers.configs import Qwen3RendererConfig
from renderers.qwen3 import Qwen3Renderer
from transformers import AutoModelForCausalLM, AutoTokenizer

from lib.config import UserError
from lib.models import qwen
from lib.models.qwen import QwenConfig, build_tokenizer, model_config, write_qwen
from lib.models.tiny import write_tiny
from lib.orchestrator import data, envs
from lib.sampling import SamplingConfig

EMPTY_THINKING = [151667, 271, 151668, 271]  # "<think>", "\n\n", "</think>", "\n\n"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Adds two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            },
        },
    },
    {"type": "function", "function": {"name": "größe", "description": "Größe in cm.", "parameters": {}}},
]
SINGLE_TURN = [
    {"role": "system", "content": "Reverse the text character-by-character."},
    {"role": "user", "content": "Hello, world 12345!"},
    {"role": "assistant", "content": "<reversed_text>\n!54321 dlrow ,olleH\n</reversed_text>"},
]
# Reasoning before the second query is dropped from history; the final turn's is kept.
MULTI_TURN = [
    {"role": "system", "content": "Sort the names."},
    {"role": "user", "content": "Ada\nBob"},
    {"role": "assistant", "content": "<think>\nA before B.\n</think>\n\nAda\nBob"},
    {"role": "user", "content": "Cy"},
    {"role": "assistant", "content": "Ada\nBob\nCy", "reasoning_content": "C comes last."},
    {"role": "user", "content": "Dee"},
    {"role": "assistant", "content": "Ada\nBob\nCy\nDee"},
]
# A tool cycle after the last query keeps its reasoning; two results share one user turn.
TOOL_CALLING = [
    {"role": "user", "content": "What is 2 + 3, and how tall is it?"},
    {
        "role": "assistant",
        "content": "<think>\nUse the tools.\n</think>\n\nLet me check.",
        "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
            {"id": "2", "type": "function", "function": {"name": "größe", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "1", "content": "5"},
    {"role": "tool", "tool_call_id": "2", "content": "180 cm"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "add", "arguments": {"a": 5, "b": 0}}}],
    },
    {"role": "tool", "tool_call_id": "3", "content": "5"},
    {"role": "assistant", "content": "<think>\nDone.\n</think>\n\n2 + 3 = 5, 180 cm."},
]
# The same tool cycle where every turn reasons: nothing in it is rewritten.
REASONED_TOOL_CALLING = [
    *TOOL_CALLING[:4],
    {**TOOL_CALLING[4], "reasoning_content": "Add zero."},
    *TOOL_CALLING[5:],
]
CHATS = {
    "single_turn": (SINGLE_TURN, None),
    "multi_turn": (MULTI_TURN, None),
    "tool_calling": (TOOL_CALLING, TOOLS),
    "reasoned_tool_calling": (REASONED_TOOL_CALLING, TOOLS),
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def qwen_dir(tokenizer, tmp_path_factory):
    return write_qwen(tmp_path_factory.mktemp("qwen") / "qwen3-test", QwenConfig(), tokenizer)


def test_token_ids_are_qwens(tokenizer):
    assert tokenizer("Hello world")["input_ids"] == [9707, 1879]
    assert tokenizer("<|im_start|>user\n")["input_ids"] == [151644, 872, 198]
    assert tokenizer("12345")["input_ids"] == [16, 17, 18, 19, 20]  # one digit per token, as Qwen's
    assert tokenizer("e\u0301")["input_ids"] == tokenizer("\u00e9")["input_ids"]  # NFC
    assert len(tokenizer) == qwen.FIRST_ADDED_ID + len(qwen.ADDED_TOKENS) == 151669
    assert tokenizer.convert_tokens_to_ids([token for token, _ in qwen.ADDED_TOKENS]) == list(
        range(151643, 151669)
    )
    assert tokenizer.eos_token_id == 151645 and tokenizer.pad_token_id == 151643
    assert set(tokenizer.all_special_ids) == set(range(151643, 151657))
    # Tool calls and reasoning survive skip_special_tokens; turn markers do not.
    ids = tokenizer("<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>")
    text = tokenizer.decode(ids["input_ids"], skip_special_tokens=True)
    assert text == "assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call>"


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("enable_thinking", [True, False])
def test_template_gives_the_qwen3_renderers_tokens(tokenizer, chat, enable_thinking):
    messages, tools = CHATS[chat]
    renderer = Qwen3Renderer(tokenizer, Qwen3RendererConfig(enable_thinking=enable_thinking))
    for end in [i + 1 for i, message in enumerate(messages) if message["role"] == "assistant"]:
        for prompt in (False, True):  # every prefix that ends with an assistant turn, and its prompt
            history = messages[: end - 1] if prompt else messages[:end]
            template = tokenizer.apply_chat_template(
                history, tools=tools, add_generation_prompt=prompt, enable_thinking=enable_thinking
            )["input_ids"]
            rendered = renderer.render_ids(history, tools=tools, add_generation_prompt=prompt)
            # renderers' one documented deviation: with thinking off it writes the empty thinking block
            # that the generation prompt prefilled into assistant turns that the template gives none.
            assert rendered == (
                template if enable_thinking else with_empty_thinking(template, tokenizer, history)
            )


def with_empty_thinking(ids: list[int], tokenizer, history: list[dict]) -> list[int]:
    """`ids` (the template's rendering of `history`) with an empty thinking block after the header of each
    assistant turn that has no reasoning and that the template writes without a thinking block (every
    one but the last, before the last query or not)."""
    last_query = max(i for i, message in enumerate(history) if message["role"] == "user")
    turns = [i for i, message in enumerate(history) if message["role"] == "assistant"]
    insert = [
        not (message.get("reasoning_content") or "</think>" in message["content"])
        and not (i > last_query and i == len(history) - 1)
        for i, message in ((i, history[i]) for i in turns)
    ]
    header = tokenizer("<|im_start|>assistant\n")["input_ids"]
    out, position, turn = [], 0, 0
    while position < len(ids):
        if ids[position : position + len(header)] == header:
            out += header + (EMPTY_THINKING if turn < len(insert) and insert[turn] else [])
            position, turn = position + len(header), turn + 1
        else:
            out.append(ids[position])
            position += 1
    return out


def rl_samples(renderer: Qwen3Renderer, messages: list[dict], tools) -> list[tuple[list[int], list[int]]]:
    """(prompt, completion) per assistant turn, as verifiers' train client builds them: the first prompt is
    rendered; each later one extends the previous prompt and completion (bridge_to_next_turn) unless the
    renderer asks for a full render (qwen3 does across a new user query, where the template rewrites
    history). The completion is what the model samples: the turn's tokens through <|im_end|>."""
    samples, previous = [], None
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = None
        if previous is not None:
            bridged = renderer.bridge_to_next_turn(*previous[0], messages[previous[1] + 1 : i], tools=tools)
            prompt = bridged.token_ids if bridged is not None else None
        if prompt is None:
            prompt = renderer.render_ids(messages[:i], tools=tools, add_generation_prompt=True)
        full = renderer.render(messages[: i + 1], tools=tools)
        completion = [token for token, index, sampled in zip(full.token_ids, full.message_indices, full.sampled_mask)
                      if index == i and sampled]  # fmt: skip
        if not renderer.config.enable_thinking and completion[:4] == EMPTY_THINKING:
            completion = completion[4:]  # the generation prompt holds it
        samples.append((prompt, completion))
        previous = ((prompt, completion), i)
    return samples


def sft_samples(tokenizer, messages: list[dict], tools) -> list[tuple[list[int], list[int]]]:
    """(prompt, trained tokens) per assistant turn, from lib.orchestrator.data's rendering through the chat template (one
    sample per turn where the template rewrites history, else one sample with a trained run per turn)."""
    out = []
    for ids, mask in data.tokenize_conversation(tokenizer, messages, tools):
        starts = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
        for start in starts:
            end = mask.index(0, start) if 0 in mask[start:] else len(mask)
            out.append((ids[:start], ids[start:end]))
    assert len(out) == sum(message["role"] == "assistant" for message in messages)
    return out


@pytest.mark.parametrize("chat", ["multi_turn", "reasoned_tool_calling"])
def test_sft_and_rl_see_the_same_tokens(tokenizer, chat):
    messages, tools = CHATS[chat]
    rl = rl_samples(Qwen3Renderer(tokenizer), messages, tools)
    sft = sft_samples(tokenizer, messages, tools)
    assert rl == sft
    # Across a new query both drop the earlier reasoning; within a tool cycle both keep it.
    last_prompt = tokenizer.decode(rl[-1][0])
    assert ("A before B." in last_prompt, "Use the tools." in last_prompt) == (False, chat != "multi_turn")


def test_an_empty_thinking_block_in_a_tool_cycle_stays_in_rl_and_leaves_sft(tokenizer):
    """Where they differ (1): a tool-calling turn without reasoning is sampled, as the last turn, after an
    empty thinking block (the template trains SFT on it too). RL's next prompt extends the tokens sampled
    and keeps the block; the template rewrites that turn, no longer the last, without it (it keeps only
    non-empty reasoning after the last query). SFT's later prompts have 4 tokens fewer per such turn."""
    messages, tools = CHATS["tool_calling"]
    rl = rl_samples(Qwen3Renderer(tokenizer), messages, tools)
    sft = sft_samples(tokenizer, messages, tools)
    assert rl[:2] == sft[:2] and rl[2][1] == sft[2][1]
    assert rl[1][1][:4] == sft[1][1][:4] == EMPTY_THINKING  # turn 2 was sampled with the empty block
    header = tokenizer("<|im_start|>assistant\n")["input_ids"]
    turn_2 = len(rl[1][0]) - len(header)  # where turn 2's header starts in both prompts
    assert rl[2][0][turn_2 : turn_2 + len(header) + 4] == header + EMPTY_THINKING
    assert rl[2][0] == sft[2][0][: turn_2 + len(header)] + EMPTY_THINKING + sft[2][0][turn_2 + len(header) :]


def test_with_thinking_disabled_rl_keeps_empty_thinking_blocks_sft_drops(tokenizer):
    """Where they differ (2): with enable_thinking=false (not plainrl's default) the renderer extends each turn
    with the tokens sampled, the prefilled empty thinking block included, while the template (and so
    SFT) leaves that block out of turns before the last query: 4 more tokens per earlier turn in RL."""
    messages = [
        {"role": "system", "content": "Sort the names."},
        {"role": "user", "content": "Ada\nBob"},
        {"role": "assistant", "content": "Ada\nBob"},
        {"role": "user", "content": "Cy"},
        {"role": "assistant", "content": "Ada\nBob\nCy"},
    ]
    rl = rl_samples(Qwen3Renderer(tokenizer, Qwen3RendererConfig(enable_thinking=False)), messages, None)
    sft = sft_samples(tokenizer, messages, None)
    # The first turn: the same tokens; RL's prompt holds the empty block, SFT trains on it.
    assert rl[0][0] + rl[0][1] == sft[0][0] + sft[0][1]
    assert rl[0][0][-4:] == sft[0][1][:4] == EMPTY_THINKING
    # The second: RL's prompt keeps turn 1's empty block, SFT's does not have it.
    assert rl[1][0] == with_empty_thinking(sft[1][0], tokenizer, messages[:4]) + EMPTY_THINKING
    assert len(rl[1][0]) == len(sft[1][0]) + 2 * len(EMPTY_THINKING)
    assert rl[1][1] == sft[1][1][4:]


def test_written_directory_loads_with_the_shape_and_the_tokenizer(tokenizer, qwen_dir):
    model = AutoModelForCausalLM.from_pretrained(qwen_dir, dtype="auto")
    config = model.config
    assert (config.model_type, config.vocab_size, config.num_hidden_layers, config.hidden_size) == (
        "qwen3",
        151936,
        2,
        256,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 64)
    assert model.dtype == torch.bfloat16 and config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.generation_config.eos_token_id == [151645, 151643]
    loaded = AutoTokenizer.from_pretrained(qwen_dir)
    messages, tools = CHATS["tool_calling"]
    assert (
        loaded.apply_chat_template(messages, tools=tools)["input_ids"]
        == tokenizer.apply_chat_template(messages, tools=tools)["input_ids"]
    )
    with torch.no_grad():
        logits = model(torch.tensor([loaded("Hello world")["input_ids"]])).logits
    assert logits.shape == (1, 2, 151936) and torch.isfinite(logits).all()


def test_untied_float32_override_and_seed(tokenizer, tmp_path):
    overrides = '{"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128}'
    config = QwenConfig(tie=False, dtype="float32", overrides=overrides, seed=3)
    model = AutoModelForCausalLM.from_pretrained(write_qwen(tmp_path / "a", config, tokenizer))
    assert not model.config.tie_word_embeddings
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.head_dim) == (1, 64, 64)
    assert model.dtype == torch.float32
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    again = AutoModelForCausalLM.from_pretrained(write_qwen(tmp_path / "b", config, tokenizer))
    assert torch.equal(model.lm_head.weight, again.lm_head.weight)


@pytest.mark.parametrize(("shape", "non_embedding"), [("0.6B", 0.44), ("1.7B", 1.4), ("4B", 3.6)])
def test_named_shapes_have_qwen3s_parameter_counts(shape, non_embedding):
    """Qwen3's model cards give the non-embedding parameters; counted on the meta device, nothing allocated."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(QwenConfig(shape=shape)))
    total = sum(parameter.numel() for parameter in model.parameters())  # tied: the embedding counted once
    embedding = model.model.embed_tokens.weight.numel()
    assert round((total - embedding) / 1e9, 2 if shape == "0.6B" else 1) == non_embedding
    assert model.config.tie_word_embeddings and model.config.head_dim == 128
    assert set(qwen.SHAPES) == {"test", "0.6B", "1.7B", "4B"}


def test_bad_overrides_are_one_sentence():
    with pytest.raises(UserError, match="qwen.overrides must be a JSON object"):
        QwenConfig(overrides="[1]")
    with pytest.raises(UserError, match="not valid JSON"):
        QwenConfig(overrides="{layers: 1}")


def test_script_writes_the_default_directory(tokenizer, tmp_path, monkeypatch, capsys):
    script = load_script("qwen")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("lib.models.qwen.build_tokenizer", lambda: tokenizer)
    out = script.main(script.Config(qwen=QwenConfig(overrides='{"num_hidden_layers": 1}')))
    assert (
        out == tmp_path / "outputs/models/qwen3-test"
        or out.resolve() == tmp_path / "outputs/models/qwen3-test"
    )
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == lines[-1] == f"run dir: {out}"


def test_the_train_client_renders_a_written_directory_with_qwen3(qwen_dir, tmp_path):
    from verifiers.v1.clients.train import ElasticRendererPool

    assert envs.renderer_name(str(qwen_dir)) == "qwen3"
    assert (
        envs.renderer_name(str(write_tiny(tmp_path / "tiny"))) == "default"
    )  # a Qwen3 without Qwen's tokens
    assert envs.renderer_name("Qwen/Qwen3-0.6B") == "qwen3" and envs.renderer_name("gpt2") == "default"
    # rl.py's path: renderer_name(model.name) into model_context, whose train client builds the renderer.
    name = envs.renderer_name(str(qwen_dir))
    context = envs.model_context("http://127.0.0.1:1/v1", "m", SamplingConfig(), True, qwen_dir, name)
    client = context.client
    pool = ElasticRendererPool(client.renderer_model_name, client.renderer, multiplex=client.multiplex)
    slot = asyncio.run(pool.grow())
    assert isinstance(slot.renderer, Qwen3Renderer)
