"""Buffer: group advantages, flat and stale groups dropped, waiting for the producer, packing into rows."""

import asyncio
import random

import pytest
import torch

from lib.buffer import Buffer, Rollout, group_advantages, is_flat, pack


def rollout(reward, version=0, length=4, first_token=0):
    return Rollout(
        token_ids=list(range(first_token, first_token + length)),
        loss_mask=[False] + [True] * (length - 1),
        inference_logp=[0.0] + [-0.5] * (length - 1),
        reward=reward,
        policy_version=version,
    )


def test_group_advantages_hand_computed():
    # mean 0.5 -> (-0.5, 0, 0.5); sample std sqrt((0.25 + 0 + 0.25) / 2) = 0.5 -> (-1, 0, 1).
    assert group_advantages([0.0, 0.5, 1.0]) == pytest.approx([-0.5, 0.0, 0.5])
    assert group_advantages([0.0, 0.5, 1.0], normalize=True) == pytest.approx([-1.0, 0.0, 1.0], abs=1e-5)
    # mean 0.25: (0.75, -0.25, -0.25, -0.25), summing to zero.
    assert group_advantages([1.0, 0.0, 0.0, 0.0]) == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert is_flat([0.3, 0.3, 0.3]) and not is_flat([0.3, 0.3, 0.31])


def test_take_drops_flat_and_stale_groups():
    async def run():
        buffer = Buffer(examples_per_step=3, max_async_level=1)
        buffer.put([rollout(0.2, version=1), rollout(0.9, version=1)])  # stale at step 3 (3 - 1 > 1)
        buffer.put([rollout(0.5, version=2), rollout(0.5, version=2)])  # flat
        buffer.put([rollout(1.0, version=3), rollout(0.0, version=3)])
        buffer.put([rollout(0.0, version=2), rollout(0.5, version=3), rollout(1.0, version=3)])
        return await buffer.take(step=3)

    batch = asyncio.run(run())
    assert len(batch.groups) == 3  # the flat group counts toward examples_per_step
    assert batch.num_flat_groups == 1 and batch.num_stale_rollouts == 2
    assert [r.advantage for r in batch.rollouts] == pytest.approx([0.5, -0.5, -0.5, 0.0, 0.5])
    # The groups (what rl.py writes to rollouts/step_N.jsonl) carry the same advantages.
    assert [r.advantage for g in batch.groups for r in g] == pytest.approx([0, 0, 0.5, -0.5, -0.5, 0, 0.5])
    assert batch.staleness_max == 1  # a version-2 rollout at step 3
    assert batch.staleness_mean == pytest.approx(3 / 7)


def test_fully_on_policy_keeps_only_the_current_version():
    async def run():
        buffer = Buffer(examples_per_step=1, max_async_level=0, normalize_advantage=True)
        buffer.put([rollout(0.0, version=4), rollout(1.0, version=5)])  # one old rollout spoils the group
        buffer.put([rollout(0.0, version=5), rollout(1.0, version=5)])
        return await buffer.take(step=5)

    batch = asyncio.run(run())
    assert batch.num_stale_rollouts == 2 and batch.staleness_max == 0
    assert [r.advantage for r in batch.rollouts] == pytest.approx([-0.7071, 0.7071], abs=1e-4)


def test_every_group_flat_means_an_empty_step_not_a_hang():
    async def run():
        buffer = Buffer(examples_per_step=2, max_async_level=0)
        buffer.put([rollout(1.0), rollout(1.0)])
        buffer.put([rollout(0.0), rollout(0.0)])
        return await asyncio.wait_for(buffer.take(step=0), timeout=5)

    batch = asyncio.run(run())
    assert batch.rollouts == [] and batch.num_flat_groups == 2


def test_take_waits_for_the_producer_and_says_how_long():
    async def producer(buffer):
        for _ in range(2):
            await asyncio.sleep(0.05)
            buffer.put([rollout(0.0), rollout(1.0)])

    async def run():
        buffer = Buffer(examples_per_step=2, max_async_level=0)
        task = asyncio.create_task(producer(buffer))
        batch = await buffer.take(step=0)
        await task
        return batch

    batch = asyncio.run(run())
    assert len(batch.rollouts) == 4
    assert 0.08 < batch.wait_seconds < 2


@pytest.mark.parametrize("packing", [True, False])
def test_pack_places_every_token_once_with_restarting_positions(packing):
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
    micro_batches = pack(
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
                    # Padding counts from 0, so it is a sequence of its own, never a continuation.
                    previous_is_padding = t > 0 and int(mb.input_ids[row, t - 1]) == -1
                    expected_position = int(mb.position_ids[row, t - 1]) + 1 if previous_is_padding else 0
                    assert int(mb.position_ids[row, t]) == expected_position
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
    assert len(seen) == sum(len(s.token_ids) for s in samples)
    assert sum(mb.num_loss_tokens() for mb in micro_batches) == sum(sum(s.loss_mask) for s in samples)


def test_pack_rejects_a_rollout_longer_than_a_row():
    with pytest.raises(ValueError, match="does not fit in seq_len 8"):
        pack([rollout(0.0, length=9)], seq_len=8)


def test_packed_row_gives_the_same_logprobs_as_separate_forwards(tiny_dir):
    from transformers import AutoModelForCausalLM

    from lib.loss import token_logp

    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    samples = [rollout(0.0, length=n, first_token=f) for n, f in ((7, 10), (5, 30), (9, 50))]
    (mb,) = pack(samples, seq_len=32, rows_per_micro_batch=1)
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
