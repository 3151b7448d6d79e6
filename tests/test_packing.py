"""Packing: first-fit rows, SFT rows and RL micro-batches from one row builder, shared prompts, packed attention."""

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_data import reverse_conversation
from transformers import AutoModelForCausalLM, AutoTokenizer

from lib.models.attention import sequence_bounds, use_packed_attention
from lib.orchestrator.data import tokenize_all
from lib.orchestrator.rollouts import Rollout
from lib.trainer.head import KeptSets
from lib.trainer.loss import token_logp
from lib.trainer.packing import first_fit, rl_micro_batches, sft_rows

TEXTS = ["hello world", "a", "plain pytorch scripts", "ok then", "reverse me please!", "xyz", "the end"]


def rollout(length: int, first_token: int) -> Rollout:
    return Rollout(
        token_ids=list(range(first_token, first_token + length)),
        loss_mask=[False] + [True] * (length - 1),
        inference_logp=[0.0] + [-0.5] * (length - 1),
        reward=0.0,
        policy_version=0,
    )


def test_sft_rows_restart_positions_and_never_predict_across_samples():
    samples = [([1, 2, 3], [0, 1, 1]), ([4, 5], [0, 1]), ([6, 7, 8, 9], [0, 0, 1, 1])]
    assert sorted(map(sorted, first_fit([3, 2, 4], seq_len=6))) == [[0], [1, 2]]  # first fit, longest first
    input_ids, position_ids, loss_mask = sft_rows(samples, seq_len=6, packing=True, pad_id=0)
    assert input_ids.tolist() == [[6, 7, 8, 9, 4, 5], [1, 2, 3, 0, 0, 0]]
    assert position_ids.tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5]]
    # mask[t]: token t is predicted from the tokens before it (next_token_scores' alignment); never a
    # sample's first token, which would be predicted from the previous sample.
    assert loss_mask.int().tolist() == [[0, 0, 1, 1, 0, 1], [0, 1, 1, 0, 0, 0]]
    unpacked = sft_rows(samples, seq_len=6, packing=False, pad_id=0)
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
        input_ids, position_ids, loss_mask = sft_rows(samples, 160, packing, tokenizer.pad_token_id)
        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        loss = -token_logp(logits, input_ids, mask=loss_mask).sum()
        loss.backward()
        return loss.item(), input_ids.shape, model.model.embed_tokens.weight.grad.clone()

    packed_loss, packed_shape, packed_grad = loss_and_grad(model, True)
    loss, shape, grad = loss_and_grad(unpacked_model, False)
    assert packed_shape[0] < shape[0] == len(TEXTS)  # several samples really share rows
    assert packed_loss == pytest.approx(loss, rel=1e-5)
    torch.testing.assert_close(packed_grad, grad, rtol=1e-4, atol=1e-6)


def test_packed_attention_takes_sample_boundaries_found_once_per_forward(tiny_dir, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    use_packed_attention(model)
    assert model.config.num_hidden_layers >= 2
    calls, diff = [], torch.diff

    def counting_diff(*args, **kwargs):
        calls.append(1)
        return diff(*args, **kwargs)

    monkeypatch.setattr(torch, "diff", counting_diff)
    samples = [([5, 6, 7, 8], [0, 1, 1, 1]), ([9, 10, 11], [0, 1, 1]), ([12, 13], [0, 1])]
    input_ids, position_ids, _ = sft_rows(samples, seq_len=9, packing=True, pad_id=0)
    with torch.no_grad():
        bounds = sequence_bounds(position_ids, *input_ids.shape)  # as lib/trainer/head.py's token_scores does
        kwargs = {"position_ids": position_ids, "use_cache": False, "packed_bounds": bounds}
        packed = model(input_ids=input_ids, **kwargs).logits
        assert len(calls) == 1, f"boundaries computed {len(calls)} times in one forward"
        # Without them, each layer finds them itself: the same answer, one host sync per layer.
        again = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        assert len(calls) == 1 + model.config.num_hidden_layers and torch.equal(packed, again)
        offset = 0
        for ids, _ in sorted(samples, key=lambda s: -len(s[0])):  # the row's order: longest first
            alone = model(input_ids=torch.tensor([ids]), use_cache=False).logits
            torch.testing.assert_close(packed[:, offset : offset + len(ids)], alone, rtol=1e-5, atol=1e-5)
            offset += len(ids)


@pytest.mark.parametrize("packing", [True, False])
def test_rl_micro_batches_place_every_token_once_with_restarting_positions(packing):
    rng = random.Random(0)
    samples = []
    for i in range(23):
        length = rng.randint(2, 40)
        mask = [False] + [rng.random() < 0.7 for _ in range(length - 1)]
        samples.append(
            Rollout(
                token_ids=[1000 * (i + 1) + j for j in range(length)],  # token -> (sample, offset)
                loss_mask=mask,
                inference_logp=[-0.01 * j for j in range(length)],
                reward=0.0,
                policy_version=0,
                advantage=float(i),
            )
        )
    micro_batches = rl_micro_batches(
        samples,
        seq_len=64,
        rows_per_micro_batch=3,
        pad_token_id=-1,
        num_micro_batches_multiple=2,
        packing=packing,
    )
    assert len(micro_batches) % 2 == 0
    if not packing:  # a row per sample, longest first
        firsts = [int(ids[0]) for mb in micro_batches for ids in mb.input_ids if int(ids[0]) != -1]
        assert sorted(firsts) == [1000 * (i + 1) for i in range(23)]
        widths = [len(samples[f // 1000 - 1].token_ids) for f in firsts]
        assert widths == sorted(widths, reverse=True)

    seen = {}
    for mb in micro_batches:
        rows, width = mb.input_ids.shape
        assert rows <= 3 and width <= 64
        assert not mb.loss_mask[mb.input_ids == -1].any()
        for row in range(rows):
            for t in range(width):
                token = int(mb.input_ids[row, t])
                if token == -1:
                    # Padding continues the row's last position (a row of one rollout stays plain causal);
                    # an empty micro-batch is one padding token at position 0.
                    expected_position = int(mb.position_ids[row, t - 1]) + 1 if t > 0 else 0
                    assert int(mb.position_ids[row, t]) == expected_position
                    assert int(mb.rollout_index[row, t]) == -1
                    continue
                i, j = divmod(token, 1000)
                i -= 1
                assert token not in seen, "a token landed twice"
                seen[token] = True
                assert int(mb.position_ids[row, t]) == j  # positions restart at each sample
                assert bool(mb.loss_mask[row, t]) == samples[i].loss_mask[j]
                expected_logp = -0.01 * j if samples[i].loss_mask[j] else 0.0
                assert mb.inference_logp[row, t].item() == pytest.approx(expected_logp)
                assert mb.advantages[row, t].item() == i
                assert int(mb.rollout_index[row, t]) == i  # which rollout of the list: the loss's sequences
    assert len(seen) == sum(len(s.token_ids) for s in samples)
    assert sum(mb.num_loss_tokens() for mb in micro_batches) == sum(sum(s.loss_mask) for s in samples)


def test_rl_micro_batches_reject_a_rollout_longer_than_a_row():
    with pytest.raises(ValueError, match="does not fit in seq_len 8"):
        rl_micro_batches([rollout(length=9, first_token=0)], seq_len=8)


def test_packed_row_gives_the_same_logprobs_as_separate_forwards(tiny_dir):
    from transformers import AutoModelForCausalLM

    from lib.trainer.loss import token_logp

    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    samples = [rollout(length=n, first_token=f) for n, f in ((7, 10), (5, 30), (9, 50))]
    (mb,) = rl_micro_batches(samples, seq_len=32, rows_per_micro_batch=1)
    with torch.no_grad():
        packed = token_logp(
            model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits, mb.input_ids
        )
        expected = {}
        for s in samples:
            ids = torch.tensor([s.token_ids])
            for j, value in enumerate(token_logp(model(input_ids=ids).logits, ids)[0].tolist()):
                expected[s.token_ids[j]] = value
    for t, token in enumerate(mb.input_ids[0].tolist()):
        if mb.loss_mask[0, t]:  # the first token of each sample has no context of its own
            assert packed[0, t].item() == pytest.approx(expected[token], abs=1e-5)


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=None, enable_gqa=False):
    """torch's varlen_attn by its definition, for CPU: one causal SDPA per cu_seqlens segment of the
    flattened (tokens, heads, dim) q/k/v."""
    assert torch.equal(cu_q, cu_k) and window_size == (-1, 0)
    bounds = cu_q.tolist()
    pieces = [
        F.scaled_dot_product_attention(
            *(x[s:e].transpose(0, 1)[None] for x in (q, k, v)),
            is_causal=True,
            scale=scale,
            enable_gqa=enable_gqa,
        )[0].transpose(0, 1)
        for s, e in zip(bounds, bounds[1:])
    ]
    return torch.cat(pieces)  # (tokens, heads, dim)


def test_under_bf16_autocast_packed_rows_take_the_varlen_kernel_which_equals_the_sdpa_loop(
    tiny_dir, monkeypatch
):
    """The trainer's float32 weights under bf16 autocast: Qwen3's q and k leave its norms and RoPE in float32,
    v in bf16; all three must reach the kernel in bf16, or packed attention falls back to the SDPA loop.
    torch's kernel has no CPU backend: CPU stands in for CUDA, with the reference kernel above."""
    from lib.models import attention

    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    assert model.config.model_type == "qwen3"
    use_packed_attention(model)
    samples = [([5, 6, 7, 8, 9], [0, 1, 1, 1, 1]), ([9, 10, 11], [0, 1, 1]), ([12, 13], [0, 1])]
    input_ids, position_ids, _ = sft_rows(samples, seq_len=10, packing=True, pad_id=0)
    seen = []

    def recording_varlen(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return reference_varlen(q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention, "varlen_kernel", lambda: ("torch", recording_varlen))

    def logits(varlen_devices):
        monkeypatch.setattr(attention, "VARLEN_DEVICES", varlen_devices)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits.float()

    monkeypatch.setattr(attention, "SHORT_SAMPLE", 0)  # every sample through SDPA, as the kernel's reference
    looped = logits(("cuda",))
    assert not seen  # on CPU: the SDPA loop
    kernel = logits(("cuda", "cpu"))
    assert seen == [(torch.bfloat16,) * 3] * model.config.num_hidden_layers, seen
    torch.testing.assert_close(kernel, looped, rtol=0, atol=0)  # the same bf16 arithmetic, sample by sample
    with torch.no_grad():  # float32, as on CPU or with model.dtype float32: no half-precision kernel
        seen.clear()
        model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    assert not seen


def test_the_varlen_kernel_without_gqa_gets_repeated_key_value_heads(monkeypatch):
    # torch 2.11's varlen_attn has no enable_gqa: packed_attention repeats the key/value heads for it and
    # must give what the per-sample SDPA loop gives (run here on CPU in bf16, as under autocast on CUDA).
    import lib.models.attention

    def varlen_without_gqa(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        assert q.shape[1] == k.shape[1] == v.shape[1] and window_size == (-1, 0), "heads must match"
        edges = cu_q.tolist()
        pieces = [
            F.scaled_dot_product_attention(
                *(x[s:e].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, scale=scale
            )[0].transpose(0, 1)
            for s, e in zip(edges, edges[1:])
        ]
        return torch.cat(pieces)  # (B * L, H, D)

    torch.manual_seed(0)
    rows, heads, kv_heads, length, dim = 2, 4, 2, 9, 8
    query = torch.randn(rows, heads, length, dim, dtype=torch.bfloat16)
    key, value = (torch.randn(rows, kv_heads, length, dim, dtype=torch.bfloat16) for _ in range(2))
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 0, 1, 2, 3]])
    looped, _ = lib.models.attention.packed_attention(
        None, query, key, value, None, position_ids=position_ids
    )
    monkeypatch.setattr(lib.models.attention, "VARLEN_DEVICES", ("cpu",))
    monkeypatch.setattr(lib.models.attention, "varlen_kernel", lambda: ("torch", varlen_without_gqa))
    kernel, _ = lib.models.attention.packed_attention(
        None, query, key, value, None, position_ids=position_ids
    )
    torch.testing.assert_close(kernel, looped, rtol=2e-2, atol=2e-2)


def test_on_a_cpu_short_bf16_samples_attend_in_float32_as_close_to_float64_as_sdpa(monkeypatch):
    # SDPA's causal CPU kernel took ~1.5x longer than two float32 matmuls over a forward and backward of
    # 100-token samples: samples up to SHORT_SAMPLE take float32_attention, longer ones SDPA. Outputs and
    # gradients must be as close to a float64 reference as the SDPA loop's.
    import lib.models.attention

    monkeypatch.setattr(lib.models.attention, "SHORT_SAMPLE", 64)
    calls = []
    float32_attention = lib.models.attention.float32_attention
    monkeypatch.setattr(
        lib.models.attention,
        "float32_attention",
        lambda q, *rest: calls.append(q.shape[2]) or float32_attention(q, *rest),
    )
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, lengths = 9, 3, 64, [40, 100, 24]  # the 100-token sample stays with SDPA
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    tensors = [
        torch.randn(1, n, sum(lengths), dim, generator=generator) * 2 for n in (heads, kv_heads, kv_heads)
    ]
    upstream = torch.randn(1, sum(lengths), heads, dim, generator=generator)

    def attend(dtype, short):
        monkeypatch.setattr(lib.models.attention, "SHORT_SAMPLE", short)
        inputs = [x.to(dtype).requires_grad_() for x in tensors]
        out, _ = lib.models.attention.packed_attention(None, *inputs, None, position_ids=position_ids)
        (out.double() * upstream).sum().backward()
        return [out.double()] + [x.grad.double() for x in inputs]

    expected = attend(torch.float64, 64)
    calls.clear()
    sdpa = attend(torch.bfloat16, 0)
    assert calls == []
    ours = attend(torch.bfloat16, 64)
    assert calls == [40, 24]
    for got, reference, exact in zip(ours, sdpa, expected):
        assert (got - exact).norm() <= 1.5 * (reference - exact).norm(), (
            (got - exact).norm(),
            (reference - exact).norm(),
        )


def grouped_rollouts(seed: int, vocabulary: int = 200) -> list[Rollout]:
    """Groups of rollouts sharing a prompt (one of two turns with an env turn between), and one alone."""
    rng = random.Random(seed)
    rollouts = []
    for group_size in (4, 3, 1):
        prompt = [rng.randrange(3, vocabulary) for _ in range(rng.randint(5, 12))]
        advantage = rng.uniform(-1, 1)
        for _ in range(group_size):
            ids, mask = list(prompt), [False] * len(prompt)
            for turn in range(rng.randint(1, 2)):
                if turn:
                    ids += [rng.randrange(3, vocabulary) for _ in range(3)]
                    mask += [False] * 3
                completion = [rng.randrange(3, vocabulary) for _ in range(rng.randint(1, 9))]
                ids += completion
                mask += [True] * len(completion)
            logp = [-rng.random() if m else 0.0 for m in mask]
            rollouts.append(Rollout(ids, mask, logp, reward=0.0, policy_version=0, advantage=advantage))
            advantage += 0.25
    return rollouts


def test_shared_prompts_hold_each_groups_prompt_once_and_split_a_group_that_outgrows_a_row():
    from lib.trainer.packing import shared_prompts

    rollouts = grouped_rollouts(0)
    lengths = [len(r.token_ids) for r in rollouts]
    prompts = [r.loss_mask.index(True) for r in rollouts]
    assert shared_prompts(rollouts, seq_len=512) == [
        ([0, 1, 2, 3], prompts[0]),
        ([4, 5, 6], prompts[4]),
        ([7], 0),
    ]
    # A row too short for the whole group: the prompt again for the members that do not fit.
    seq_len = prompts[0] + sum(n - prompts[0] for n in lengths[:2])
    units = shared_prompts(rollouts[:4], seq_len)
    assert units == [([0, 1], prompts[0]), ([2, 3], prompts[0])], units

    for i, r in enumerate(
        rollouts
    ):  # served kept sets: token t of rollout i keeps ids 1000 i + t and one more
        r.kept_counts = np.array([2 if m else 0 for m in r.loss_mask], dtype=np.int32)
        r.kept_ids = np.array(
            [1000 * i + t + k for t, m in enumerate(r.loss_mask) if m for k in (0, 1)], np.int32
        )
    micro_batches = rl_micro_batches(rollouts, 512, rows_per_micro_batch=4, share_prompts=True)
    (mb,) = micro_batches
    kept = KeptSets(ids=mb.kept_ids, counts=mb.kept_counts).select(
        mb.loss_mask
    )  # as lib/trainer/head.py reads them
    tokens = mb.loss_mask.nonzero().tolist()  # row-major, the order the head scores them in
    first_ids = [1000 * int(mb.rollout_index[r, t]) + int(mb.position_ids[r, t]) for r, t in tokens]
    assert kept.counts.tolist() == [2] * len(tokens) and kept.ids[::2].tolist() == first_ids
    assert (mb.input_ids != 0).sum() == sum(lengths) - sum(prompts[1:4]) - sum(prompts[5:7])
    assert mb.num_loss_tokens() == sum(sum(r.loss_mask) for r in rollouts)
    for i, r in enumerate(rollouts):  # every rollout's tokens, its prompt's included, at its own positions
        (row,) = {int(row) for row in (mb.rollout_index == i).nonzero()[:, 0]}
        sampled = mb.loss_mask[row] & (mb.rollout_index[row] == i)
        positions = mb.position_ids[row][sampled].tolist()
        assert positions == [t for t, m in enumerate(r.loss_mask) if m]
        assert mb.input_ids[row][sampled].tolist() == [t for t, m in zip(r.token_ids, r.loss_mask) if m]
        assert mb.inference_logp[row][sampled].tolist() == pytest.approx(
            [lp for lp in r.inference_logp if lp]
        )
        assert mb.advantages[row][sampled].tolist() == pytest.approx([r.advantage] * sum(r.loss_mask))


@pytest.mark.parametrize("compute", ["float32", "bf16", "bf16-sdpa"])
def test_shared_prompts_give_every_token_the_logprob_and_gradient_of_the_whole_rollout(
    tiny_dir, compute, monkeypatch
):
    """The shared layout's forward and backward against each rollout laid out whole (both packed): every
    sampled token's logprob and entropy, and the weights' gradient of an advantage-weighted loss. bf16 runs
    short samples through float32_attention (with the branch mask), bf16-sdpa through SDPA's masked kernel."""
    from lib.models import attention
    from lib.trainer.head import next_token_scores, use_chunked_head

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped heads under a mask
    use_packed_attention(model)
    use_chunked_head(model)
    if compute == "bf16-sdpa":
        monkeypatch.setattr(attention, "SHORT_SAMPLE", 0)
    rollouts = grouped_rollouts(1, model.config.vocab_size)

    def scores_and_gradient(share):
        model.zero_grad()
        scores, tokens = {}, 0
        for mb in rl_micro_batches(rollouts, 128, rows_per_micro_batch=2, share_prompts=share):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute != "float32"):
                logp, entropy = next_token_scores(model, mb.input_ids, mb.position_ids, mb.loss_mask)
            (logp * mb.advantages * mb.loss_mask).sum().backward()
            tokens += int((mb.rollout_index >= 0).sum())
            for row, t in mb.loss_mask.nonzero().tolist():
                key = (int(mb.rollout_index[row, t]), int(mb.position_ids[row, t]))
                scores[key] = (logp[row, t].item(), entropy[row, t].item())
        gradient = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return scores, gradient, tokens

    whole, whole_gradient, whole_tokens = scores_and_gradient(False)
    shared, shared_gradient, shared_tokens = scores_and_gradient(True)
    assert shared_tokens < whole_tokens and sorted(shared) == sorted(whole)
    assert len(whole) == sum(sum(r.loss_mask) for r in rollouts)
    # bf16: logprobs within 2e-3 measured; leaving out the branch mask or the branches' first-token fix
    # moved them by 0.1-0.24.
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if compute == "float32" else {"rtol": 0, "atol": 0.01}
    torch.testing.assert_close(
        torch.tensor([shared[k] for k in sorted(whole)]),
        torch.tensor([whole[k] for k in sorted(whole)]),
        **tolerance,
    )
    relative = (shared_gradient - whole_gradient).norm() / whole_gradient.norm()
    assert relative < (1e-5 if compute == "float32" else 1e-2), relative  # bf16: 2.8e-3 measured
