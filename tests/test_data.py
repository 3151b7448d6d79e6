"""SFT data: assistant-only masks through the chat template, record formats, packing and the packed loss."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from lib.data import (
    IGNORE,
    batch_indices,
    load_conversations,
    make_rows,
    pack,
    tokenize_all,
    tokenize_conversation,
    use_packed_attention,
)
from lib.envs import EnvConfig

SYSTEM = "Reverse the text."


def reverse_conversation(text: str) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": text},
        {"role": "assistant", "content": f"<r>{text[::-1]}</r>"},
    ]


TEXTS = ["hello world", "a", "plain pytorch scripts", "ok then", "reverse me please!", "xyz", "the end"]


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


def test_rows_restart_positions_and_never_predict_across_samples():
    samples = [([1, 2, 3], [0, 1, 1]), ([4, 5], [0, 1]), ([6, 7, 8, 9], [0, 0, 1, 1])]
    assert sorted(map(sorted, pack([3, 2, 4], seq_len=6))) == [[0], [1, 2]]  # first fit, longest first
    input_ids, position_ids, targets = make_rows(samples, seq_len=6, packing=True, pad_id=0)
    assert input_ids.tolist() == [[6, 7, 8, 9, 4, 5], [1, 2, 3, 0, 0, 0]]
    assert position_ids.tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5]]
    assert targets.tolist() == [[IGNORE, 8, 9, IGNORE, 5, IGNORE], [2, 3, IGNORE, IGNORE, IGNORE, IGNORE]]
    unpacked = make_rows(samples, seq_len=6, packing=False, pad_id=0)
    assert unpacked[0].shape == (3, 4) and unpacked[1][1].tolist() == [0, 1, 2, 3]  # padding continues


@pytest.mark.parametrize("attention", ["sdpa", "packed"])
def test_packed_loss_equals_unpacked_loss(tiny_dir, attention):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    unpacked_model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    if attention == "packed":
        use_packed_attention(model)
    samples, _ = tokenize_all(tokenizer, [reverse_conversation(t) for t in TEXTS], seq_len=512)

    def loss_and_grad(model, packing):
        model.zero_grad()
        input_ids, position_ids, targets = make_rows(samples, 160, packing, tokenizer.pad_token_id)
        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
        loss.backward()
        return loss.item(), input_ids.shape, model.model.embed_tokens.weight.grad.clone()

    packed_loss, packed_shape, packed_grad = loss_and_grad(model, True)
    loss, shape, grad = loss_and_grad(unpacked_model, False)
    assert packed_shape[0] < shape[0] == len(TEXTS)  # several samples really share rows
    assert packed_loss == pytest.approx(loss, rel=1e-5)
    torch.testing.assert_close(packed_grad, grad, rtol=1e-4, atol=1e-6)


def test_packed_attention_finds_sample_boundaries_once_per_forward(tiny_dir, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    use_packed_attention(model)
    assert model.config.num_hidden_layers >= 2
    calls, diff = [], torch.diff

    def counting_diff(*args, **kwargs):
        calls.append(1)
        return diff(*args, **kwargs)

    monkeypatch.setattr(torch, "diff", counting_diff)
    samples = [([5, 6, 7, 8], [0, 1, 1, 1]), ([9, 10, 11], [0, 1, 1]), ([12, 13], [0, 1])]
    input_ids, position_ids, _ = make_rows(samples, seq_len=9, packing=True, pad_id=0)
    with torch.no_grad():
        packed = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        assert len(calls) == 1, f"boundaries computed {len(calls)} times in one forward"
        offset = 0
        for ids, _ in sorted(samples, key=lambda s: -len(s[0])):  # the row's order: longest first
            alone = model(input_ids=torch.tensor([ids]), use_cache=False).logits
            torch.testing.assert_close(packed[:, offset : offset + len(ids)], alone, rtol=1e-5, atol=1e-5)
            offset += len(ids)
