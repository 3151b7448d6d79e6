"""The builtin engine in-process (lib/inference/server/engine.py, lib/inference/server/decode.py): sampling filters, the queue, pause and close."""

import logging
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT

from lib.inference.server.decode import SamplingParams
from lib.inference.server.engine import Engine
from lib.inference.server.sampler import draw, processed_logprobs
from lib.models.load import ModelConfig

# What an AVX2-only CPU (no AVX-512) looks like to torch's kernels, oneDNN and MKL on any x86-64 CPU.
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def test_top_k_and_top_p_filter_and_renormalise():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.4, 0.3, 0.2, 0.1]]))
    logprobs = processed_logprobs(
        logits, torch.ones(3), torch.tensor([2, 4, 4]), torch.tensor([1.0, 0.7, 1.0]), filtered=True
    )
    probs = logprobs.exp()
    assert torch.allclose(probs[0], torch.tensor([0.625, 0.375, 0, 0]))  # top-2, renormalised
    assert torch.allclose(probs[1], torch.tensor([0.625, 0.375, 0, 0]))  # 0.5 + 0.3 >= 0.7
    assert torch.allclose(probs[2], torch.tensor([0.4, 0.3, 0.2, 0.1]))  # untouched


def test_draw_samples_each_rows_distribution_and_never_a_filtered_token():
    probs = torch.tensor([[0.5, 0.25, 0.0, 0.25], [0.0, 0.1, 0.0, 0.9], [0.0, 0.0, 0.0, 1.0]])
    logprobs = probs.log()  # -inf where filtered out
    count = 40_000
    uniform = torch.rand(count, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for row, p in enumerate(probs):
        tokens = draw(logprobs[row].expand(count, -1), uniform)
        frequency = torch.bincount(tokens, minlength=4).double() / count
        standard_error = (p.double() * (1 - p.double()) / count).sqrt()
        assert (frequency - p.double()).abs().le(4 * standard_error + 1e-12).all(), (row, frequency)
    # The ends of [0, 1), and 1 itself, still land on tokens that can be drawn.
    edges = torch.tensor([0.0, 1 - 2**-53, 1.0], dtype=torch.float64)
    for row, p in enumerate(probs):
        assert all(p[token] > 0 for token in draw(logprobs[row].expand(3, -1), edges).tolist())
    # Across many-token rows (SmolLM2's vocabulary) the float64 sums keep the last token reachable.
    wide = torch.full((1, 49_152), -math.log(49_152))
    assert draw(wide, torch.tensor([1 - 2**-53], dtype=torch.float64)).item() == 49_151


@pytest.mark.slow
def test_draw_gives_every_token_of_a_span_exactly_its_probability():
    """The exact chance of each token, found by bisection on the uniform number (draw is monotone in it), over
    whole spans of a 49,152-token row: a span's last token of tiny mass must get neither the rounding gap
    between the span's float32 total and the float64 running sum inside it (the 2.5e-11 and 8.1e-12 it got
    for 1.4e-11 and 3.1e-13) nor lose it; a token filtered out is never drawn."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(49_152, generator=generator) * 4
    spans = (3, 41)
    for span in spans:  # a tiny last token, a filtered one before it
        logits[span * 256 + 255] = logits.max() - 24.0 - span / 10
        logits[span * 256 + 254] = -math.inf
    logprobs = torch.log_softmax(logits, dim=-1)
    probs = logprobs.exp().double()  # the float32 probabilities the sampler is given
    ids = torch.tensor([span * 256 + offset for span in spans for offset in range(257)])  # each span's edges
    low = torch.zeros(len(ids), dtype=torch.float64)  # draws a token before ids
    high = torch.ones(len(ids), dtype=torch.float64)  # draws ids or a later one
    for _ in range(56):  # to 2**-56, below the tolerance
        middle = (low + high) / 2
        later = draw(logprobs.expand(len(ids), -1), middle) >= ids
        high, low = torch.where(later, middle, high), torch.where(later, low, middle)
    edges = high.unflatten(0, (len(spans), 257))  # the least uniform number drawing each token or a later one
    chance = edges[:, 1:] - edges[:, :-1]  # (spans, 256)
    expected = probs[ids].unflatten(0, (len(spans), 257))[:, :256] / probs.sum()  # (spans, 256)
    gap = (chance - expected).abs()  # (spans, 256)
    worst = int(gap.argmax())
    shown = (
        ids.unflatten(0, (len(spans), 257))[:, :256].flatten()[worst].item(),
        expected.flatten()[worst].item(),
    )
    assert bool((gap <= 1e-6 * expected + 1e-15).all()), (*shown, chance.flatten()[worst].item())
    assert bool((chance[:, 254] == 0).all())  # filtered out: never drawn
    assert bool((expected[:, 255] < 1e-10).all() and (expected[:, 255] > 1e-13).all())


def test_engine_skips_requests_whose_caller_left_and_fails_queued_ones_on_close(tiny_dir):
    engine = Engine(ModelConfig(name=str(tiny_dir), device="cpu"))
    engine.pause()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    gone, kept = engine.submit([5, 6], params), engine.submit([7, 8], params)
    assert gone.cancel()  # what asyncio does to the future when the HTTP client disconnects
    engine.resume()
    assert len(kept.result(timeout=60)[0].token_ids) == 4 and gone.cancelled()
    engine.pause()
    queued = engine.submit([5], params)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        queued.result(timeout=10)


def test_a_wait_pause_after_a_keep_pause_lets_the_held_sequence_finish(tiny_dir):
    engine = Engine(ModelConfig(name=str(tiny_dir), device="cpu"))
    future = engine.submit(list(range(5, 25)), SamplingParams(max_tokens=400, ignore_eos=True))
    deadline = time.monotonic() + 60
    while not engine._busy:  # the sequence is running
        assert time.monotonic() < deadline, "the sequence did not start in 60 s"
        time.sleep(0.01)
    engine.pause("keep")  # held mid-sequence
    assert not future.done()
    engine.pause("wait")  # vLLM's wait: returns once the running sequences are done
    assert future.done() and len(future.result()[0].token_ids) == 400
    engine.resume()
    engine.close()


def test_waiting_sequences_join_a_running_batch_together_or_after_a_few_steps(tiny_dir):
    # Each join prefills the newcomers and lays the whole KV cache out again: one newcomer beside 16 running
    # rows waits up to ADMIT_AFTER_STEPS decode steps for others, a quarter of the rows' worth joins at once.
    from lib.inference.server import engine as engine_module

    engine = Engine(ModelConfig(name=str(tiny_dir), device="cpu"))
    steps = []  # (rows running, newcomers) of each step
    real_step = engine.decoder.step

    def step(batch, new, label):
        steps.append((len(batch.seqs) if batch else 0, len(new)))
        return real_step(batch, new, label)

    engine.decoder.step = step
    try:
        running = [
            engine.submit([5 + i, 6], SamplingParams(max_tokens=300, ignore_eos=True)) for i in range(16)
        ]
        deadline = time.monotonic() + 60
        while not steps:
            assert time.monotonic() < deadline, "the batch did not start in 60 s"
            time.sleep(0.01)
        short = SamplingParams(max_tokens=2, ignore_eos=True)
        for newcomers, waits in ((1, getattr(engine_module, "ADMIT_AFTER_STEPS", 8)), (4, 0)):
            engine.pause("keep")  # between two steps: the newcomers are all waiting when it resumes
            futures = [engine.submit([7, 8, 9], short) for _ in range(newcomers)]
            resumed = len(steps)
            engine.resume()
            for future in futures:
                assert len(future.result(timeout=60)[0].token_ids) == 2
            after = steps[resumed:]
            joined = next(i for i, (_, new) in enumerate(after) if new)
            assert (joined, after[joined]) == (waits, (16, newcomers)), after[: joined + 1]
        assert all(len(f.result(timeout=120)[0].token_ids) == 300 for f in running)
    finally:
        engine.close()


def test_a_decode_step_returns_the_finished_rows_and_keeps_the_others(tiny_dir):
    from lib.inference.server.decode import Decoder, Sequence
    from lib.models.load import load_model

    model = load_model(ModelConfig(name=str(tiny_dir), device="cpu"))
    decoder = Decoder(model, pad_id=0, detokenize=lambda ids, skip: "x" * len(ids), seed=0)

    def sequence(prompt: list[int], max_tokens: int) -> Sequence:
        return Sequence(prompt, SamplingParams(max_tokens=max_tokens), None, frozenset(), None, 0)

    short, long = sequence([5, 6, 7], 1), sequence([8, 9], 3)
    with torch.inference_mode():
        batch, finished = decoder.step(None, [short, long], "v1")  # prefill samples one token, decode one
        assert [seq for seq, _ in finished] == [short] and batch.seqs == [long] and len(long.token_ids) == 2
        (completion,) = [completion for _, completion in finished]
        assert completion.finish_reason == "length" and completion.weight_versions == [("v1", 0, 1)]
        batch, finished = decoder.step(batch, [], "v2")
    assert batch is None and [seq for seq, _ in finished] == [long]
    assert finished[0][1].weight_versions == [("v1", 0, 2), ("v2", 2, 3)] and finished[0][1].text == "xxx"


def decoded(decoder, prompts: list[list[int]], max_tokens: int = 6) -> list:
    """Each prompt decoded to max_tokens new tokens through `decoder`: [(sequence, completion)]."""
    from lib.inference.server.decode import Sequence

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seqs = [Sequence(prompt, params, None, frozenset(), None, 0) for prompt in prompts]
    batch, done = None, []
    with torch.inference_mode():
        batch, finished = decoder.step(batch, seqs, "v")
        done += finished
        while batch is not None:
            batch, finished = decoder.step(batch, [], "v")
            done += finished
    return done


def full_forward_logprobs(model, seq, completion) -> torch.Tensor:
    """The completion's token logprobs from one forward of the whole sequence."""
    ids = torch.tensor([seq.prompt_ids + completion.token_ids])
    with torch.inference_mode():
        logp = model(ids).logits[0, :-1].float().log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
    return logp[len(seq.prompt_ids) - 1 :]


def test_decode_groups_the_key_value_heads_in_the_kernel_without_copying_them(tiny_dir, monkeypatch):
    # transformers' sdpa copies the key/value heads of a grouped-query model up to the query heads whenever a
    # mask is given (every batched decode step); on CPU that copy was 15% of the engine's time and the
    # attention 3-4x slower than SDPA's own grouping. The answers stay the model's: the grouped decode's
    # logprobs equal a full forward's.
    from transformers.integrations import sdpa_attention

    from lib.inference.server.decode import Decoder
    from lib.models.load import load_model

    copies = []
    repeat_kv = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *args: copies.append(1) or repeat_kv(*args))
    model = load_model(ModelConfig(name=str(tiny_dir), device="cpu", dtype="float32"))
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    decoder = Decoder(model, pad_id=0, detokenize=lambda ids, skip: "", seed=0)
    # Unequal lengths: a left-padded batch, decoded under a mask.
    done = decoded(decoder, [[5, 6, 7, 8, 9], [10, 11]])
    assert copies == [] and len(done) == 2
    for seq, completion in done:
        expected = full_forward_logprobs(model, seq, completion)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, rtol=0, atol=1e-5)


def test_rows_leaving_and_joining_a_batch_in_blocks_keep_every_sequences_logprobs(tiny_dir):
    # The engine's CPU cache holds 32-token blocks (lib/inference/server/kv.py BlockLayer). A long prompt's row leaves
    # early: the rows left drop the whole blocks of padding in front of them. A longer prompt then joins:
    # the rows already there are padded to its length. Every served logprob stays a full forward's.
    from lib.inference.server.decode import Decoder, Sequence
    from lib.inference.server.kv import BLOCK, BlockLayer
    from lib.models.load import load_model

    model = load_model(ModelConfig(name=str(tiny_dir), device="cpu", dtype="float32"))
    decoder = Decoder(model, pad_id=0, detokenize=lambda ids, skip: "", seed=0)

    def sequence(prompt: list[int], max_tokens: int) -> Sequence:
        return Sequence(
            prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None, frozenset(), None, 0
        )

    long, short, joining = (
        sequence(list(range(5, 85)), 3),
        sequence([10, 11], 12),
        sequence(list(range(7, 47)), 6),
    )
    done, widths = [], []
    with torch.inference_mode():
        batch, finished = decoder.step(None, [long, short], "v")
        for step in range(12):
            batch, finished = decoder.step(batch, [joining] if step == 4 else [], "v")
            done += finished
            if batch is not None:
                widths.append(batch.attention_mask.shape[1])
                assert all(type(layer) is BlockLayer for layer in batch.cache.layers)
    assert {seq for seq, _ in done} == {long, short, joining}
    assert 82 + 2 - 2 * BLOCK in widths  # the short row alone: two blocks of padding dropped, not re-blocked
    for seq, completion in done:
        expected = full_forward_logprobs(model, seq, completion)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, rtol=0, atol=1e-5)


def test_prompts_scored_for_their_logprobs_run_through_the_model_once_together(tiny_dir, monkeypatch):
    # A distillation teacher's requests (prompt_logprobs, one token) each ran its prompt through the model twice,
    # alone: scoring's forward, then the batch's prefill. Now the scored prompts are prefilled together, left-
    # padded, keeping every position's hidden state for their logprobs. What is served stays a full forward's:
    # the prompts' logprobs and the sampled tokens'.
    from lib.inference.server.decode import Decoder, Sequence
    from lib.models.load import load_model

    model = load_model(ModelConfig(name=str(tiny_dir), device="cpu", dtype="float32"))
    decoder = Decoder(model, pad_id=0, detokenize=lambda ids, skip: "", seed=0)
    prefilled = []  # (rows, positions) of every forward of more than one position
    forward = model.model.forward

    def counted(*args, **kwargs):
        if kwargs["input_ids"].shape[1] > 1:
            prefilled.append(tuple(kwargs["input_ids"].shape))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model.model, "forward", counted)
    scoring = SamplingParams(3, ignore_eos=True, prompt_logprobs=1)
    scored = [Sequence(list(range(5, 5 + n)), scoring, None, frozenset(), None, 0) for n in (40, 17)]
    plain = Sequence([8, 9, 10], SamplingParams(3, ignore_eos=True), None, frozenset(), None, 0)
    done = []
    with torch.inference_mode():
        batch, finished = decoder.step(None, [scored[0], plain, scored[1]], "v")
        done += finished
        while batch is not None:
            batch, finished = decoder.step(batch, [], "v")
            done += finished
    assert sorted(prefilled) == [(1, 3), (2, 40)]  # before: (1, 40), (1, 17) and (3, 40)
    assert {seq for seq, _ in done} == {plain, *scored}
    for seq, completion in done:
        expected = full_forward_logprobs(model, seq, completion)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, rtol=0, atol=1e-5)
        if seq in scored:
            ids = torch.tensor([seq.prompt_ids])
            with torch.inference_mode():
                logp = model(ids).logits[0, :-1].float().log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
            served = torch.tensor([entries[0][1] for entries in completion.prompt_logprobs])
            torch.testing.assert_close(served, logp, rtol=0, atol=1e-5)


def test_bf16_linear_layers_take_the_cpus_path_and_compute_what_plain_ones_do_after_a_reload(
    tiny_dir, tmp_path, caplog
):
    # On a CPU in bf16 the engine multiplies by copies of the linear weights laid out once for oneDNN where
    # oneDNN can lay bf16 out (AVX-512 or AVX-NE-CONVERT), by the weights themselves elsewhere (AVX2 only):
    # either way the logits are bit for bit the plain model's, before and after a reload (lib/inference/server/linear.py).
    from lib.inference.server import linear
    from lib.models.load import cpu_has_bf16

    packs = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # what oneDNN says it can do here, asked another way
    print(f"bf16 linear layers checked on this CPU: {'prepacked' if packs else 'plain matmuls'}")
    print(f"native bf16 (the trainer's and serve.py's auto dtype): {cpu_has_bf16()}")
    assert packs or not cpu_has_bf16()  # where auto picks bf16, oneDNN computes it
    assert linear.cpu_packs_bf16() == packs
    said = "prepacked for oneDNN" if packs else f"plain bf16 matmuls ({linear.PLAIN_REASON})"
    check_linear_layers(tiny_dir, tmp_path, caplog, "bfloat16", packs, said, tolerance=0)


def test_float32_linear_layers_are_prepacked_on_a_cpu_and_compute_what_plain_ones_do_after_a_reload(
    tiny_dir, tmp_path, caplog
):
    # In float32 oneDNN lays the weights out on every CPU (AVX2 included), where MKL's plain matmuls were
    # 1.4x slower at a decode step's rows: the logits differ from the plain model's only by the order of the sums.
    check_linear_layers(tiny_dir, tmp_path, caplog, "float32", True, "prepacked for oneDNN", tolerance=1e-5)


def check_linear_layers(tiny_dir, tmp_path, caplog, dtype: str, packs: bool, said: str, tolerance: float):
    """The engine's linear layers are prepacked (`packs`) or plain, its log says which (`said`), and its logits
    are the plain model's within `tolerance` (0: bit for bit), before and after a reload, and decode runs."""
    from safetensors.torch import save_file

    from lib.inference.server import linear
    from lib.models.load import load_model

    config = ModelConfig(name=str(tiny_dir), device="cpu", dtype=dtype)
    with caplog.at_level(logging.INFO, logger="lib.inference.server.engine"):
        engine = Engine(config)
    plain = load_model(config)

    def same(a, b):
        torch.testing.assert_close(a, b, rtol=0, atol=tolerance)

    try:
        assert engine.prepacked == packs
        layers = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
        assert all(hasattr(m, "packed") == packs for m in layers)
        assert [r.message for r in caplog.records if "linear layers" in r.message] == [
            f"linear layers: {said}"
        ]
        ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
        with torch.inference_mode():
            same(engine.model(ids).logits, plain(ids).logits)
            # New weights, as a trainer's step writes them: every linear layer moved.
            state = {name: tensor.clone() for name, tensor in plain.state_dict().items()}
            for name in state:
                if name.endswith("proj.weight"):
                    state[name] += 0.05 * torch.randn_like(state[name])
            (tmp_path / "step").mkdir()
            save_file(state, tmp_path / "step" / "model.safetensors")
            engine.reload(tmp_path / "step")
            plain.load_state_dict(state)
            moved = engine.model(ids).logits
            same(moved, plain(ids).logits)
            if packs:
                linear.prepack(plain)  # the same forward, prepacked here: unchanged
                assert torch.equal(moved, plain(ids).logits)
        # Decode steps go through the same layers.
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        (completion,) = engine.submit([5, 6, 7], params).result(timeout=60)
        assert len(completion.token_ids) == 4
    finally:
        engine.close()


def test_a_cpu_lowered_to_avx2_serves_bf16_through_plain_matmuls(tmp_path):
    # On a CPU with AVX-512 the AVX2-only path runs too, with the CPU that torch and oneDNN see lowered
    # (docs/testing.md): the test above again, in a process of its own, which must take the plain path.
    test = "test_bf16_linear_layers_take_the_cpus_path_and_compute_what_plain_ones_do_after_a_reload"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", f"{__file__}::{test}", "-s", "-p", "no:cacheprovider"]
        + ["--basetemp", str(tmp_path)],
        env={**os.environ, **AVX2_ONLY},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "bf16 linear layers checked on this CPU: plain matmuls" in result.stdout, result.stdout[-4000:]
    assert "native bf16 (the trainer's and serve.py's auto dtype): False" in result.stdout


def test_a_cpu_lowered_to_avx2_multiplies_float32_with_mkls_avx2_kernels():
    # torch's float32 matmuls on a CPU go to MKL, which picks its kernels from the CPU's own flags: lowering
    # torch and oneDNN alone left them on AVX-512, 1.5x an AVX2 CPU's rate at a trainer's shapes, so the
    # trainer measured "lowered" was faster than on a real AVX2-only CPU. MKL_VERBOSE names the ISA it took.
    assert torch.backends.mkl.is_available(), "the x86-64 CPU build of torch multiplies through MKL"
    matmul = "import torch; torch.randn(64, 576) @ torch.randn(576, 1536)"
    result = subprocess.run(
        [sys.executable, "-c", matmul],
        env={**os.environ, **AVX2_ONLY, "MKL_VERBOSE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (header,) = [line for line in result.stdout.splitlines() if "oneMKL" in line and "architecture" in line]
    # Which lesser path MKL takes differs by vendor (AVX2 on Intel's CPUs); never AVX-512 or AMX.
    assert "AVX-512" not in header and "AMX" not in header, header


def test_equal_prompts_are_prefilled_once_and_each_sequence_then_samples_its_own_tokens(tiny_dir):
    # A group's rollouts arrive together with one prompt (8 a group in the presets): the prefill runs each
    # distinct prompt once and copies its keys and values to every sequence that asked for it.
    from lib.inference.server.decode import Decoder
    from lib.models.load import load_model

    model = load_model(ModelConfig(name=str(tiny_dir), device="cpu", dtype="float32"))
    shapes = []  # (rows, tokens) of each forward
    model.get_input_embeddings().register_forward_hook(
        lambda _m, inputs, _out: shapes.append(inputs[0].shape)
    )
    decoder = Decoder(model, pad_id=0, detokenize=lambda ids, skip: "", seed=0)
    first, second = [5, 6, 7, 8, 9], [10, 11]
    done = decoded(decoder, [first, second, first, first, second], max_tokens=8)
    assert shapes[0] == (2, 5) and {rows for rows, _ in shapes[1:]} == {5}  # then every step extends all 5
    assert len({tuple(c.token_ids) for seq, c in done if seq.prompt_ids == first}) > 1  # sampled apart
    for seq, completion in done:
        expected = full_forward_logprobs(model, seq, completion)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, rtol=0, atol=1e-5)


def test_prompts_that_begin_alike_prefill_their_common_beginning_once(tiny_dir):
    # An evaluation's prompts share their system prompt (30 of SmolLM2's 42 tokens on arithmetic), and each
    # prefill ran it once a row. Now the beginning all of a prefill's prompts share runs once, its keys and
    # values copied to every row, whose padding then lies between it and the row's own tokens; every served
    # logprob stays a full forward's, through decode steps and a later join.
    from lib.inference.server.decode import SHARED_PREFIX, Decoder, Sequence
    from lib.models.load import load_model

    model = load_model(ModelConfig(name=str(tiny_dir), device="cpu", dtype="float32"))
    shapes = []  # (rows, tokens) of each forward
    model.get_input_embeddings().register_forward_hook(
        lambda _m, inputs, _out: shapes.append(tuple(inputs[0].shape))
    )
    decoder = Decoder(model, pad_id=0, detokenize=lambda ids, skip: "", seed=0)
    common = list(range(40, 40 + SHARED_PREFIX + 4))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first = [common + [5, 6, 7], common + [8], common + [9, 10, 11, 12, 13]]
    joining = [[3] + common + [14, 15], [3] + common + [16]]  # alike over a longer beginning, joined later
    first, joining = (
        [Sequence(p, params, None, frozenset(), None, 0) for p in ps] for ps in (first, joining)
    )
    done = []
    with torch.inference_mode():
        batch, _ = decoder.step(None, first, "v")
        for step in range(12):
            batch, finished = decoder.step(batch, joining if step == 2 else [], "v")
            done += finished
    assert batch is None and {seq for seq, _ in done} == {*first, *joining}
    prefills = [shape for shape in shapes if shape[1] > 1]
    # before: (3, len(common) + 5) and (2, len(common) + 3)
    assert prefills == [(1, len(common)), (3, 5), (1, len(common) + 1), (2, 2)]
    # Shorter than SHARED_PREFIX alike, or a single prompt: one forward of the whole prompts, as before.
    shapes.clear()
    decoded(decoder, [[1, 2, 3, 4], [1, 2, 3, 5, 6]], max_tokens=2)
    decoded(decoder, [common], max_tokens=2)
    assert [shape for shape in shapes if shape[1] > 1] == [(2, 5), (1, len(common))]
    for seq, completion in done:
        expected = full_forward_logprobs(model, seq, completion)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_steps_attention_is_as_close_to_float64_as_sdpas(dtype):
    # A decode step's attention (one query token a row, SmolLM2's 9 query heads over 3 key/value heads, left
    # padding masked) goes through two float32 matmuls instead of SDPA's CPU kernel, which took 4-5x longer on
    # this shape. Its error against a float64 reference must be no larger than SDPA's own.
    import torch.nn.functional as F

    from lib.inference.server.kv import BlockLayer
    from lib.models.attention import float32_attention
    from lib.models.load import grouped_sdpa

    generator = torch.Generator().manual_seed(0)
    rows, heads, groups, length, dim = 8, 9, 3, 40, 64
    query, key, value = (
        (torch.randn(rows, n, t, dim, generator=generator) * 2).to(dtype)
        for n, t in ((heads, 1), (groups, length + 8), (groups, length + 8))
    )
    key, value = key[:, :, :length], value[:, :, :length]  # a view of a longer buffer, as a cache could hold
    mask = torch.ones(rows, 1, 1, length, dtype=torch.bool)
    mask[0, ..., :30] = mask[3, ..., :5] = False  # left padding
    expected = F.scaled_dot_product_attention(
        query.double(),
        key.double().repeat_interleave(3, 1),
        value.double().repeat_interleave(3, 1),
        attn_mask=mask,
    ).transpose(1, 2)  # (rows, 1, heads, dim)
    sdpa = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    ours = float32_attention(query, key, value, mask).transpose(1, 2)
    assert ours.shape == expected.shape and ours.dtype == dtype
    sdpa_error = (sdpa.double() - expected).abs().max()
    # SDPA's own error depends on the CPU's kernel: 2.6e-6 on an Intel Xeon where ours was 7.1e-6 (outputs of
    # magnitude ~2: float32's rounding over a 64-term dot product and a softmax), so the floor is float32's.
    assert (ours.double() - expected).abs().max() <= sdpa_error * 1.5 + 1e-5
    # The same step through the attention function the models call, under a bf16 autocast region too.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        via_interface, _ = grouped_sdpa(None, query, key, value, mask)
    torch.testing.assert_close(via_interface, ours, rtol=0, atol=0)
    additive = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))  # a float mask
    torch.testing.assert_close(
        float32_attention(query, key, value, additive).transpose(1, 2), ours, rtol=0, atol=0
    )
    # The same step over the cache in blocks (lib/inference/server/kv.py BlockLayer), as the engine's decode reads it.
    layer = BlockLayer(torch.float32)
    layer.update(key[:, :, :-1], value[:, :, :-1])
    blocks = layer.update(key[:, :, -1:], value[:, :, -1:])
    for visible in (mask, additive, None):
        expected_here = ours if visible is not None else float32_attention(query, key, value).transpose(1, 2)
        via_blocks, _ = grouped_sdpa(None, query, *blocks, visible)
        torch.testing.assert_close(
            via_blocks, expected_here, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-2
        )


@pytest.mark.parametrize("kind", ["GrowingLayer", "BlockLayer"])
def test_the_kv_cache_grows_in_place_and_holds_what_concatenation_would(kind):
    # A decode step writes its token into room at the end of the layer's buffers instead of concatenating the
    # history again; past the room, the buffers are copied into larger ones. Either way they hold the history.
    # A BlockLayer hands a decode step its blocks (zeros past the last token), a prefill its own states.
    from lib.inference.server import kv

    layer = getattr(kv, kind)(torch.float32)
    chunks = [torch.randn(2, 3, n, 4, dtype=torch.bfloat16) for n in (10, *[1] * 150, 5)]
    buffers = set()
    for i, chunk in enumerate(chunks):
        given = layer.update(chunk, -chunk)
        keys, values = layer.states()
        buffers.add(layer.room[0].untyped_storage().data_ptr())
        history = torch.cat(chunks[: i + 1], dim=2).float()
        assert keys.dtype == torch.float32 and layer.get_seq_length() == history.shape[2]
        assert torch.equal(keys, history) and torch.equal(values, -history)
        if kind == "GrowingLayer" or i == len(chunks) - 1:  # (a BlockLayer's many-token update: its states)
            assert all(torch.equal(a, b) for a, b in zip(given, (keys, values)))
        elif i == 0:
            assert given[0] is chunk
        else:
            (block_keys, block_values), length = given, history.shape[2]
            assert block_keys.length == block_values.length == length
            blocks = block_keys.data.shape[0]
            assert blocks == -(-length // kv.BLOCK) and block_keys.data.shape[1:] == (2, 3, kv.BLOCK, 4)
            laid_out = block_keys.data.permute(1, 2, 0, 3, 4).flatten(2, 3)  # (2, 3, blocks x BLOCK, 4)
            assert torch.equal(laid_out[:, :, :length], history) and not laid_out[:, :, length:].any()
    assert 1 < len(buffers) < 5  # 166 tokens in a few buffers, not one per step


# Run in a process of its own: a server's engine built on the main thread, then reloaded and fingerprinted
# from another thread, as routes.py's asyncio.to_thread does. Prints the threads each step started.
ONE_TEAM = """
import os, sys, threading, torch
from lib.inference.server.decode import SamplingParams
from lib.inference.server.engine import Engine
from lib.models.load import ModelConfig

def threads():  # the process's threads that run no Python: OpenMP's
    return set(map(int, os.listdir("/proc/self/task"))) - {t.native_id for t in threading.enumerate()}

torch.set_num_threads(2)
before = threads()
engine = Engine(ModelConfig(name=sys.argv[1], device="cpu"))
engine.submit([5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True)).result(timeout=60)
started = threads() - before
print("engine", len(started))
done = threading.Event()

def elsewhere():
    torch.set_num_threads(2)
    mark = threads()
    engine.reload(sys.argv[1])
    engine.weight_fingerprint()
    print("elsewhere", len(threads() - mark))
    done.set()

threading.Thread(target=elsewhere).start()
done.wait(60)
engine.close()
"""


def test_only_the_engines_worker_computes_with_several_threads(tiny_dir):
    # libgomp spins its threads ~100 rounds instead of ~300,000 once it manages more than the CPU's cores:
    # a second thread's team of OpenMP threads (the model loaded on the main thread, a reload's copy on an
    # asyncio worker) made every parallel operator of the decode step sleep and wake its threads (a 32-row
    # SmolLM2 step 180 ms instead of 147, float32, 2 cores). A new team shows as new threads of the process.
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, "-c", ONE_TEAM, str(tiny_dir)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    counts = dict(
        line.split() for line in result.stdout.splitlines() if line.startswith(("engine", "elsewhere"))
    )
    # The worker's own team: one thread beside it. Nothing started by the reload and the fingerprint.
    assert counts == {"engine": "1", "elsewhere": "0"}, result.stdout


# Page faults of a 40 MB tensor made and freed (over glibc's largest mmap threshold, 32 MB: by default a
# mapping of its own each time, faulted in page by page), before and after the engine or the trainer loads
# the tiny model, in a process of its own.
FAULTS_AROUND_A_LOAD = """
import resource, sys, torch
from lib.models.load import ModelConfig

def faults_a_tensor():
    for _ in range(3):  # the heap settles
        torch.ones(10 << 20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        torch.ones(10 << 20)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5

print(faults_a_tensor())
config = ModelConfig(name=sys.argv[1], device="cpu")
if sys.argv[2] == "engine":
    from lib.inference.server.engine import Engine

    Engine(config).close()
else:
    from lib.trainer.trainable import LoraConfig, load_trainable

    load_trainable(config, LoraConfig(), "cpu", world_size=1, packing=True)
print(faults_a_tensor())
"""


@pytest.mark.parametrize("loader", ["engine", "trainer"])
def test_the_engine_and_the_trainer_keep_the_memory_they_free_for_their_next_allocations(tiny_dir, loader):
    """A decode step or a training step allocates its large tensors anew every time; glibc handed each one
    back to the kernel when freed, and the next was faulted in again page by page (~12,000 faults a bf16
    SmolLM2 decode step of 64 rows, ~100,000 a training step). glibc's malloc, as on every Linux the suite
    runs on."""
    result = subprocess.run(
        [sys.executable, "-c", FAULTS_AROUND_A_LOAD, str(tiny_dir), loader],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    before, after = map(float, result.stdout.split()[-2:])
    assert before > 5000, before  # 40 MB of 4 KiB pages, faulted in each time
    assert after < 100, (before, after)
