"""SFT data: assistant-only masks through the chat template, record formats, the seeded epoch order."""

import json

import pytest
from transformers import AutoTokenizer

from lib.orchestrator.data import batch_indices, load_conversations, tokenize_conversation
from lib.orchestrator.tasks import EnvConfig

SYSTEM = "Reverse the text."


def reverse_conversation(text: str) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": text},
        {"role": "assistant", "content": f"<r>{text[::-1]}</r>"},
    ]


def trained_text(tokenizer, ids, mask) -> list[str]:
    """The masked-in tokens as text, one string per contiguous span."""
    spans, current = [], []
    for token, keep in zip(ids, mask):
        if keep:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    return spans + ([tokenizer.decode(current)] if current else [])


def test_only_assistant_turns_carry_loss(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    conversation = [
        {"role": "system", "content": "Sort the names."},
        {"role": "user", "content": "Bob\nAda"},
        {"role": "assistant", "content": "Ada\nBob"},
        {"role": "user", "content": "Cy"},
        {"role": "assistant", "content": "Ada\nBob\nCy"},
    ]
    [(ids, mask)] = tokenize_conversation(tokenizer, conversation)
    assert ids == list(tokenizer.apply_chat_template(conversation, return_dict=True)["input_ids"])
    # Each reply and its end-of-turn token; not the generation prompt, not the newline after it.
    assert trained_text(tokenizer, ids, mask) == ["Ada\nBob<|im_end|>", "Ada\nBob\nCy<|im_end|>"]


def test_template_that_rewrites_history_gives_one_sample_per_turn(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    # Like Qwen3 dropping old reasoning: earlier assistant turns render shortened.
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'][:1] }}{% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    conversation = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "first reply"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "second reply"},
    ]
    samples = tokenize_conversation(tokenizer, conversation)
    assert [trained_text(tokenizer, ids, mask) for ids, mask in samples] == [
        ["first reply<|im_end|>"],
        ["second reply<|im_end|>"],
    ]
    assert "f<|im_end|>" in tokenizer.decode(samples[1][0])  # the second sees the history as rendered


def test_a_conversation_without_assistant_turn_is_an_error(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    with pytest.raises(ValueError, match="no assistant message"):
        tokenize_conversation(tokenizer, [{"role": "user", "content": "hi"}])


def test_jsonl_messages_and_prompt_completion_records_agree(tmp_path):
    conversation = reverse_conversation("abc")
    records = [
        {"messages": conversation},
        {"prompt": conversation[:2], "completion": conversation[2:]},
        {"prompt": [{"role": "user", "content": "abc", "tool_calls": None}], "completion": "<r>cba</r>"},
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(record) for record in records) + "\n\n")
    loaded = load_conversations(EnvConfig(id=str(path)))
    assert loaded[0] == loaded[1] == conversation
    assert loaded[2] == conversation[1:]  # plain strings become user / assistant turns; extra keys dropped
    assert len(load_conversations(EnvConfig(id=str(path), num_examples=1))) == 1
    with pytest.raises(ValueError, match="does not exist"):
        load_conversations(EnvConfig(id=str(tmp_path / "missing.jsonl")))


def test_batches_walk_through_each_epoch_once_in_a_seeded_order():
    first_epoch = [i for step in range(5) for i in batch_indices(step, 4, 20, seed=3)]
    assert sorted(first_epoch) == list(range(20)) and first_epoch != list(range(20))
    assert batch_indices(2, 4, 20, seed=3) == batch_indices(2, 4, 20, seed=3)
    assert batch_indices(5, 4, 20, seed=3) != batch_indices(0, 4, 20, seed=3)  # epoch 2 is reshuffled


def test_json_and_parquet_files_load_and_a_bad_file_fails_before_the_run_directory(tiny_dir, tmp_path):
    import pyarrow
    import pyarrow.parquet
    from conftest import load_script

    from lib.config import parse

    conversation = reverse_conversation("abc")
    records = [{"messages": conversation}, {"prompt": conversation[:2], "completion": conversation[2:]}]
    (tmp_path / "data.json").write_text(json.dumps(records))
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(records[:1]), tmp_path / "data.parquet")
    assert load_conversations(EnvConfig(id=str(tmp_path / "data.json"))) == [conversation, conversation]
    assert load_conversations(EnvConfig(id=str(tmp_path / "data.parquet"))) == [conversation]

    sft = load_script("sft")
    (tmp_path / "wrong.jsonl").write_text(json.dumps({"question": "abc", "answer": "cba"}) + "\n")
    for name, message in [
        ("wrong.jsonl", r"record 1 needs `messages` .* got keys \['answer', 'question'\]"),
        ("missing.json", "data file .*missing.json does not exist"),
    ]:
        argv = [
            "--model.name",
            str(tiny_dir),
            "--data.id",
            str(tmp_path / name),
            "--output-dir",
            str(tmp_path / "run"),
        ]
        with pytest.raises(ValueError, match=message):
            sft.main(parse(sft.Config, argv))
        assert not (tmp_path / "run").exists()
