"""The tiny model: Hugging Face round trip, determinism, build time and a prefix-stable chat template (tools too)."""

import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lib.models.tiny import CHARACTERS, TinyConfig, write_tiny


def test_save_load_round_trip_gives_identical_logits(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    ids = torch.tensor([tokenizer("Reverse me, please!")["input_ids"]])
    reloaded_dir = tiny_dir.parent / "resaved"
    model.save_pretrained(reloaded_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(reloaded_dir).eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
    assert type(model).__name__ == "Qwen3ForCausalLM"


def test_same_seed_same_weights_other_seed_other_weights(tmp_path):
    def weights(seed, name):
        path = write_tiny(tmp_path / name, TinyConfig(seed=seed))
        return AutoModelForCausalLM.from_pretrained(path).model.embed_tokens.weight

    assert torch.equal(weights(0, "a"), weights(0, "b"))
    assert not torch.equal(weights(0, "a"), weights(1, "c"))


def test_builds_in_under_two_seconds(tmp_path):
    write_tiny(tmp_path / "warm")  # imports are not part of the build
    start = time.perf_counter()
    write_tiny(tmp_path / "timed")
    assert time.perf_counter() - start < 2.0


def test_tokenizer_is_character_level_and_lossless(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    text = "".join(CHARACTERS)
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text) and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) < 110


def test_chat_template_is_prefix_stable_over_three_turns(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    conversation = [
        {"role": "system", "content": "Sort the names."},
        {"role": "user", "content": "Ada\nBob"},
        {"role": "assistant", "content": "<s>\nAda\nBob\n</s>"},
        {"role": "user", "content": "Cy"},
        {"role": "assistant", "content": "<s>\nAda\nBob\nCy\n</s>"},
        {"role": "user", "content": "Dee"},
        {"role": "assistant", "content": "done"},
    ]

    def render(messages, **kwargs):
        return list(tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)["input_ids"])

    for end in (3, 5):  # each full turn is a prefix of the conversation with one more turn
        assert render(conversation[: end + 2])[: len(render(conversation[:end]))] == render(
            conversation[:end]
        )
    # The generation prompt plus the reply plus <|im_end|> is exactly the rendered assistant turn.
    prompt = render(conversation[:2], add_generation_prompt=True)
    full = render(conversation[:3])
    reply = tokenizer(conversation[2]["content"] + "<|im_end|>")["input_ids"]
    assert full[: len(prompt)] == prompt and full[len(prompt) : len(prompt) + len(reply)] == reply
    text = tokenizer.apply_chat_template(conversation[:2], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_tiny_template_renders_tools_calls_and_results_turn_by_turn(tiny_dir):
    import plainrl_calculator as calc

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    data = calc.CalculatorData(prompt="What is 3*4?", system_prompt="S", expression="3*4", answer="12")
    messages, tools = calc.reference_conversation(data), calc.reference_tools()
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text.startswith('<|im_start|>system\nS\n\nTools:\n<tools>\n{"name": "calculate"')
    assert (
        '<|im_start|>assistant\n<tool_call>{"name": "calculate", "arguments": {"expression": "3*4"}}</tool_call>'
        in text
    )
    assert "<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>" in text
    # The markers are single tokens, and each turn renders as a prefix of the longer conversation.
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<tool_call>") in ids
    for end in range(1, len(messages)):
        part = tokenizer.apply_chat_template(messages[:end], tools=tools, tokenize=True, return_dict=True)
        assert list(ids[: len(part["input_ids"])]) == list(part["input_ids"])
    # A call whose arguments arrive as a JSON string (OpenAI's wire form) renders the same.
    wire = [dict(m) for m in messages]
    wire[2] = {
        **wire[2],
        "tool_calls": [
            {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
            for c in wire[2]["tool_calls"]
        ],
    }
    assert tokenizer.apply_chat_template(wire, tools=tools, tokenize=False) == text


def test_a_write_cut_short_leaves_no_model_and_keeps_the_previous_one(tmp_path, monkeypatch):
    import hashlib

    import pytest
    from transformers import PreTrainedTokenizerFast

    def contents(directory):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}

    old = write_tiny(tmp_path / "old", TinyConfig(seed=1))
    (old / "notes.txt").write_text("the user's own file")
    before = contents(old)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", killed)
    for out in (tmp_path / "new", old):
        with pytest.raises(KeyboardInterrupt):
            write_tiny(out)
    assert not (tmp_path / "new").exists()
    assert contents(old) == before
    monkeypatch.undo()
    write_tiny(old)
    assert (old / "notes.txt").read_text() == "the user's own file"
    assert contents(old)["model.safetensors"] == contents(write_tiny(tmp_path / "fresh"))["model.safetensors"]
