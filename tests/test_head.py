"""The chunked output layer (lib/head.py): the same logprobs, entropy and gradients as full logits, without them."""

import peft
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from lib import head
from lib.loss import entropy, token_logp
from lib.qwen import QwenConfig, write_qwen

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def tied_qwen(tmp_path_factory):
    """2 layers, the full 151,936-row vocabulary, the output layer tied to the embedding."""
    return write_qwen(tmp_path_factory.mktemp("qwen") / "tied", QwenConfig(shape="test", dtype="float32"))


def batch(vocab: int):
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (2, 24), generator=generator)
    position_ids = torch.tensor(
        [list(range(10)) + list(range(14)), list(range(24))]
    )  # a packed row, a plain one
    mask = torch.zeros(2, 24, dtype=torch.bool)
    mask[0, 4:10], mask[0, 16:], mask[1, 5:] = True, True, True
    return input_ids, position_ids, mask


def scored(model, chunked: bool, input_ids, position_ids, mask):
    """Per-token logp and entropy, and every trainable parameter's gradient of a weighted logp sum."""
    model.zero_grad()
    if chunked:
        logp, ent = head.next_token_scores(model, input_ids, position_ids, mask, TEMPERATURE)
    else:
        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        logp = token_logp(logits, input_ids, TEMPERATURE, mask)
        ent = entropy(logits, TEMPERATURE, mask)
    weights = torch.linspace(-1, 2, logp.numel()).reshape(logp.shape)  # advantages of both signs
    (logp * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return logp.detach(), ent, grads


@pytest.mark.parametrize("kind", ["untied", "tied", "lora"])
def test_chunks_give_the_full_logits_logprobs_entropy_and_gradients(kind, tiny_dir, tied_qwen, monkeypatch):
    path = tied_qwen if kind == "tied" else tiny_dir
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.tie_word_embeddings == (kind == "tied")
    if kind == "lora":
        targets = ["q_proj", "v_proj", "down_proj"]
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
        for name, parameter in model.named_parameters():  # B starts at 0: move it so A gets a gradient too
            if "lora_B" in name:
                parameter.data.normal_(std=0.1)
    head.use_chunked_head(model)
    monkeypatch.setattr(head, "CHUNK_TOKENS", 5)  # 33 scored tokens: seven chunks, the last one short
    inputs = batch(model.config.vocab_size)
    logp, ent, grads = scored(model, True, *inputs)
    ref_logp, ref_ent, ref_grads = scored(model, False, *inputs)
    assert inputs[2][:, 1:].sum() == 33 and (logp != 0).sum() == 33
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys() and grads
    if kind == "lora":
        assert all("lora_" in name for name in grads)
    else:
        assert any("embed_tokens" in name for name in grads)
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        # float32 sums over 151,936 vocabulary rows in another order: ~1e-6 of the gradient's scale.
        scale = ref_grads[name].abs().max().item()
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_without_a_scoring_request_the_output_layer_gives_logits(tiny_dir):
    """Generation and the sync probe call the model as usual."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    input_ids, position_ids, _ = batch(model.config.vocab_size)
    before = model(input_ids=input_ids, position_ids=position_ids).logits
    head.use_chunked_head(model)
    after = model(input_ids=input_ids, position_ids=position_ids).logits
    assert torch.equal(before, after) and model.get_output_embeddings().scoring is None
    assert set(model.state_dict()) == set(AutoModelForCausalLM.from_pretrained(tiny_dir).state_dict())


def test_bf16_autocast_matches_the_full_logits_under_autocast(tiny_dir, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    head.use_chunked_head(model)
    monkeypatch.setattr(head, "CHUNK_TOKENS", 8)
    inputs = batch(model.config.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _, grads = scored(model, True, *inputs)
        ref_logp, _, ref_grads = scored(model, False, *inputs)
    # Both run the output layer's matmul in bf16; they differ in the order of float32 sums only.
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=2e-2)
    for name, grad in grads.items():
        assert F.cosine_similarity(grad.flatten(), ref_grads[name].flatten(), dim=0) > 0.99, name


def test_a_micro_batch_without_scored_tokens_scores_nothing(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    head.use_chunked_head(model)
    input_ids, position_ids, mask = batch(model.config.vocab_size)
    logp, ent = head.next_token_scores(model, input_ids, position_ids, torch.zeros_like(mask))
    assert logp.shape == ent.shape == input_ids.shape and not logp.any() and not ent.any()


def vocabulary_sized_allocations(trainable: bool) -> list[str]:
    """The ops that made a new (V, H) tensor during the chunked head's backward, with the weight trainable
    or frozen (LoRA): every op's outputs are seen under a dispatch mode, so no allocation escapes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    vocab, hidden_size = 50, 8
    weight = torch.randn(vocab, hidden_size, requires_grad=trainable)
    hidden = torch.randn(6, hidden_size, requires_grad=True)
    logp, _ = head.ChunkedTokenLogprobs.apply(hidden, weight, torch.arange(6), 1.0, 4)
    seen = []

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, tuple | list) else [out]:
                if isinstance(tensor, torch.Tensor) and tensor.shape == weight.shape:
                    if tensor.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr():
                        seen.append(str(func))
            return out

    with Allocations():
        logp.sum().backward()
    assert hidden.grad is not None and (weight.grad is not None) == trainable
    return seen


def test_a_frozen_output_layer_gets_no_vocabulary_sized_gradient_buffer():
    """With LoRA the output layer is frozen: a float32 (V, H) buffer would be 0.58 GiB at Qwen3-0.6B."""
    assert vocabulary_sized_allocations(trainable=True)  # the method sees the buffer when there is one
    assert vocabulary_sized_allocations(trainable=False) == []
