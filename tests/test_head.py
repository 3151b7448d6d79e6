"""The chunked output layer (lib/trainer/head.py): the same logprobs, entropy and gradients as full logits, without them."""

import peft
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from lib.models.qwen import QwenConfig, write_qwen
from lib.trainer import head
from lib.trainer.loss import entropy, token_logp

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


@pytest.mark.slow
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


def test_the_entropy_gradient_is_minus_p_times_log_p_plus_h_by_hand():
    """One row, the identity as output layer (logits = hidden): d H / d hidden = -p (log p + H) / temperature."""
    import math

    z = [1.0, 0.0, -1.0]
    hidden = torch.tensor([z], requires_grad=True)
    logp, ent = head.ChunkedTokenLogprobs.apply(hidden, torch.eye(3), torch.tensor([0]), 0.5, 4)
    total = sum(math.exp(x / 0.5) for x in z)
    p = [math.exp(x / 0.5) / total for x in z]  # 0.867, 0.117, 0.016
    h = -sum(q * math.log(q) for q in p)
    assert ent.item() == pytest.approx(h, rel=1e-6) and logp.item() == pytest.approx(math.log(p[0]), rel=1e-6)
    (3 * ent + 2 * logp).sum().backward()  # both terms at once, as an entropy bonus beside the policy loss
    expected = [(3 * -q * (math.log(q) + h) + 2 * ((j == 0) - q)) / 0.5 for j, q in enumerate(p)]
    torch.testing.assert_close(hidden.grad[0], torch.tensor(expected), rtol=1e-5, atol=1e-6)


def small_tied_model(tiny_dir):
    """The tiny model's shape (a small vocabulary) with its output layer tied to the embedding."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_dir, tie_word_embeddings=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("kind", ["untied", "tied", "lora"])
def test_the_entropy_gradient_through_the_chunks_is_the_full_logits_one(kind, tiny_dir, monkeypatch):
    """An entropy bonus trains through the chunked backward: the same gradients as the entropy of full logits."""
    if kind == "tied":
        model = small_tied_model(tiny_dir)
    else:
        model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    assert model.config.tie_word_embeddings == (kind == "tied")
    if kind == "lora":
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"])
        )
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.data.normal_(std=0.1)
    head.use_chunked_head(model)
    monkeypatch.setattr(head, "CHUNK_TOKENS", 5)
    input_ids, position_ids, mask = batch(model.config.vocab_size)
    weights = torch.linspace(-1, 2, input_ids.numel()).reshape(input_ids.shape)

    def gradients(chunked: bool):
        model.zero_grad()
        if chunked:
            logp, ent = head.next_token_scores(model, input_ids, position_ids, mask, TEMPERATURE)
        else:
            logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
            logprobs = (logits[:, :-1].float() / TEMPERATURE).log_softmax(-1)  # (B, T-1, V)
            ent = F.pad(-(logprobs.exp() * logprobs).sum(-1), (1, 0)) * F.pad(mask[:, 1:], (1, 0))  # (B, T)
            logp = token_logp(logits, input_ids, TEMPERATURE, mask)
        (ent * weights - 0.1 * logp).sum().backward()  # the bonus's gradient dominates
        return ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    ent, grads = gradients(chunked=True)
    ref_ent, ref_grads = gradients(chunked=False)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys() and grads
    assert all("lora_" in name for name in grads) if kind == "lora" else any("embed" in n for n in grads)
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        scale = ref_grads[name].abs().max().item()
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_the_entropy_gradient_over_served_kept_sets_is_the_masked_logits_one():
    """With top-k/top-p the entropy is over each token's kept set: its gradient is 0 outside the set."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 4, requires_grad=True), torch.randn(6, 4, requires_grad=True)
    targets = torch.tensor([0, 2, 5])
    kept_rows = [[0, 1], [2, 3, 4], [5, 0, 1, 2]]
    counts = torch.tensor([len(ids) for ids in kept_rows], dtype=torch.int32)
    kept = head.KeptSets(ids=torch.tensor(sum(kept_rows, []), dtype=torch.int32), counts=counts)
    logp, ent = head.ChunkedTokenLogprobs.apply(hidden, weight, targets, TEMPERATURE, 2, kept)
    (ent * torch.tensor([1.0, -2.0, 3.0]) + logp).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    allowed = torch.zeros(3, 6, dtype=torch.bool)
    for row, ids in enumerate(kept_rows):
        allowed[row, ids] = True
    logprobs = (hidden @ weight.t() / TEMPERATURE).masked_fill(~allowed, float("-inf")).log_softmax(-1)
    ref_ent = -(logprobs.exp() * logprobs.masked_fill(~allowed, 0.0)).sum(-1)
    ref_logp = logprobs.gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(ent, ref_ent.detach())
    torch.testing.assert_close(logp, ref_logp.detach())
    (ref_ent * torch.tensor([1.0, -2.0, 3.0]) + ref_logp).sum().backward()
    assert grads[0].abs().sum() > 0 and grads[1].abs().sum() > 0
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], weight.grad, rtol=1e-5, atol=1e-6)
