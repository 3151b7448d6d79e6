"""Packing: sequences into rows of seq_len (SFT rows and RL micro-batches alike, a group's prompt shared)."""

import dataclasses
from typing import TYPE_CHECKING

from lib.config import UserError

if TYPE_CHECKING:
    import torch

    from lib.orchestrator.rollouts import Rollout


# ---------------------------------------------------------------- rows


def first_fit(lengths: list[int], seq_len: int) -> list[list[int]]:
    """First-fit decreasing: sequence indices grouped into rows of at most seq_len tokens."""
    rows, free = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > seq_len:
            raise UserError(
                f"a sequence of {lengths[i]} tokens does not fit in seq_len {seq_len}; raise seq_len."
            )
        for r, space in enumerate(free):
            if lengths[i] <= space:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(seq_len - lengths[i])
    return rows


def row_layout(lengths: list[int], seq_len: int, packing: bool) -> list[list[int]]:
    """Which sequences share each row: first-fit packed, or one per row, longest first (rows taken in
    order then pad little)."""
    if packing:
        return first_fit(lengths, seq_len)
    return [[i] for i in sorted(range(len(lengths)), key=lambda i: -lengths[i])]


def build_rows(layout: list[list[int]], columns: dict[str, tuple[list[list], object, "torch.dtype"]]) -> dict:
    """(R, T) tensors, one per column plus position_ids: row r holds the sequences layout[r] back to back,
    padded on the right to the longest row. A column is (values per sequence, padding value, dtype).

    Positions restart at 0 for each sequence, which is how transformers and packed_attention tell
    packed sequences apart (no attention_mask is passed). Padding continues the last position, so it
    reads as part of the row's last sequence: causal attention keeps real tokens from seeing it, and a
    row of one sequence stays plain causal (no mask is built). A "position_ids" column gives the positions
    instead (a shared prompt's branches, shared_prompts).
    """
    import torch

    lengths = {i: len(next(iter(columns.values()))[0][i]) for row in layout for i in row}
    width = max(sum(lengths[i] for i in row) for row in layout)
    columns = dict(columns)
    given = columns.pop("position_ids", None)  # a shared prompt's branches continue its positions
    tensors = {}
    for name, (per_sequence, padding, dtype) in columns.items():
        assert all(len(per_sequence[i]) == n for i, n in lengths.items()), f"column {name} differs in length"
        tensor = torch.full((len(layout), width), padding, dtype=dtype)  # (R, T)
        for r, row in enumerate(layout):
            values = [value for i in row for value in per_sequence[i]]
            tensor[r, : len(values)] = torch.tensor(values, dtype=dtype)
        tensors[name] = tensor
    position_ids = torch.arange(width).repeat(len(layout), 1)  # (R, T)
    for r, row in enumerate(layout):
        positions = [t for i in row for t in (given[0][i] if given else range(lengths[i]))]
        position_ids[r, : len(positions)] = torch.tensor(positions)
        position_ids[r, len(positions) :] += positions[-1] + 1 - len(positions)
    tensors["position_ids"] = position_ids
    return tensors


def sft_rows(samples: list[tuple[list[int], list[int]]], seq_len: int, packing: bool, pad_id: int):
    """SFT rows of (token ids, 0/1 loss mask) samples: input ids, position ids and the loss mask, each
    (rows, length), aligned as RL's are: mask[t] marks a token t the model is trained to predict from the
    tokens before it (lib/trainer/head.py next_token_scores). A sample's first token is never trained on: it would
    be predicted from the previous sample of the row."""
    import torch

    masks = [[False] + [bool(m) for m in mask[1:]] for _, mask in samples]
    layout = row_layout([len(ids) for ids, _ in samples], seq_len, packing)
    rows = build_rows(
        layout,
        {
            "input_ids": ([ids for ids, _ in samples], pad_id, torch.long),
            "loss_mask": (masks, False, torch.bool),
        },
    )
    return rows["input_ids"], rows["position_ids"], rows["loss_mask"]


@dataclasses.dataclass
class MicroBatch:
    """One RL forward/backward's worth of rows (see build_rows); every tensor is (R, T).

    Call the model with position_ids, no attention_mask and use_cache=False (with a KV cache
    transformers skips the check and lets packed rollouts attend to each other).
    """

    input_ids: "torch.Tensor"
    """Token ids (long); padding after the last rollout of a row."""
    position_ids: "torch.Tensor"
    """Position of each token within its own rollout (long); padding continues the last rollout's."""
    loss_mask: "torch.Tensor"
    """True on sampled tokens (bool); False on prompts, env turns and padding."""
    inference_logp: "torch.Tensor"
    """Server logprob of each token (float32); 0 off the loss mask."""
    advantages: "torch.Tensor"
    """The rollout's advantage on each of its tokens (float32); 0 on padding."""
    rollout_index: "torch.Tensor"
    """Which rollout of the step's list each token belongs to (long); -1 on padding; a shared prompt's, its first
    rollout's. A rollout lies whole in one row of one micro-batch, so sequence-level quantities (lib/trainer/loss.py)
    are complete in the micro-batch."""
    kept_counts: "torch.Tensor | None" = None
    """Served kept sets: how many kept ids each token has (int32), > 0 on the loss mask; None when the rollouts
    carry none (lib/trainer/head.py KeptSets)."""
    kept_ids: "torch.Tensor | None" = None
    """Served kept sets: every token's kept ids (int32, (K,)), one token after the other, rows in order."""
    teacher_logp: "torch.Tensor | None" = None
    """Distillation: the teacher's logprob of each token (float32), 0 off the loss mask; None without a teacher."""

    def to(self, device) -> "MicroBatch":
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return MicroBatch(
            **{name: None if value is None else value.to(device) for name, value in fields.items()}
        )

    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def shared_prompts(rollouts: list["Rollout"], seq_len: int) -> list[tuple[list[int], int]]:
    """Rollouts grouped into the units a row holds: (rollout indices, prompt length). Rollouts whose tokens
    up to their first sampled one are the same (a group's prompt) make one unit as long as it fits seq_len:
    the prompt once, then each rollout's remaining tokens as a branch that attends to it and to itself
    (its positions continue the prompt's). Any other rollout is a unit of its own, prompt length 0."""
    by_prompt: dict[tuple, list[int]] = {}
    for i, r in enumerate(rollouts):
        if True in r.loss_mask:
            by_prompt.setdefault(tuple(r.token_ids[: r.loss_mask.index(True)]), []).append(i)
    units, shared = [], set()
    for prompt, members in by_prompt.items():
        if len(members) < 2:
            continue
        shared.update(members)
        unit, length = [], len(prompt)
        for i in members:
            branch = len(rollouts[i].token_ids) - len(prompt)
            if unit and length + branch > seq_len:
                units.append((unit, len(prompt)))
                unit, length = [], len(prompt)
            unit.append(i)
            length += branch
        units.append((unit, len(prompt)))
    units += [([i], 0) for i in range(len(rollouts)) if i not in shared]
    return sorted(units, key=lambda unit: unit[0][0])  # in the rollouts' order


def rl_micro_batches(
    rollouts: list["Rollout"],
    seq_len: int,
    rows_per_micro_batch: int = 1,
    pad_token_id: int = 0,
    num_micro_batches_multiple: int = 1,
    packing: bool = True,
    share_prompts: bool = False,
) -> list[MicroBatch]:
    """Rollouts in rows of at most seq_len tokens (one per row with packing off, then the model needs no
    packed attention), rows_per_micro_batch rows to a micro-batch, each padded to its longest row. With
    share_prompts (packing on), a group's rollouts hold their common prompt once (shared_prompts): the
    forward and backward skip the copies, and every token's logprob and gradient are those of the rollout
    laid out whole (tests/test_packing.py).

    Empty micro-batches (one padding token, no loss) are appended until their number is a multiple of
    num_micro_batches_multiple, so every rank runs the same number of forward/backward passes in lockstep.
    """
    import torch

    for r in rollouts:
        assert len(r.token_ids) == len(r.loss_mask) == len(r.inference_logp), (
            "rollout fields differ in length"
        )
        # token_logp gives the first token of a packed rollout a value predicted from the previous one.
        assert not r.loss_mask[0], "a rollout cannot start with a sampled token (it has no context)"
    assert packing or not share_prompts, "shared prompts need packed rows"
    units = shared_prompts(rollouts, seq_len) if share_prompts else [([i], 0) for i in range(len(rollouts))]

    def column(values_of, prompt_value=None):
        """Per unit: the prompt's values once (the first member's, or prompt_value), then each member's rest."""
        per_unit = []
        for members, prompt in units:
            first = values_of(members[0])
            head = first[:prompt] if prompt_value is None else [prompt_value] * prompt
            per_unit.append(list(head) + [v for i in members for v in list(values_of(i))[prompt:]])
        return per_unit

    columns = {
        "input_ids": (column(lambda i: rollouts[i].token_ids), pad_token_id, torch.long),
        "loss_mask": (column(lambda i: rollouts[i].loss_mask), False, torch.bool),
        "inference_logp": (
            column(
                lambda i: [
                    lp if m else 0.0 for lp, m in zip(rollouts[i].inference_logp, rollouts[i].loss_mask)
                ]
            ),
            0.0,
            torch.float32,
        ),
        "advantages": (
            column(lambda i: [rollouts[i].advantage] * len(rollouts[i].token_ids)),
            0.0,
            torch.float32,
        ),
        "rollout_index": (column(lambda i: [i] * len(rollouts[i].token_ids)), -1, torch.long),
        "position_ids": (column(lambda i: range(len(rollouts[i].token_ids))), 0, torch.long),
    }
    served = [r.kept_counts is not None for r in rollouts]
    assert all(served) or not any(served), "some rollouts carry served kept sets and others none"
    if rollouts and all(served):
        columns["kept_counts"] = (column(lambda i: rollouts[i].kept_counts.tolist(), 0), 0, torch.int32)
    scored = [r.teacher_logp is not None for r in rollouts]
    assert all(scored) or not any(scored), "some rollouts carry the teacher's logprobs and others none"
    if rollouts and all(scored):
        teacher = column(
            lambda i: [t if m else 0.0 for t, m in zip(rollouts[i].teacher_logp, rollouts[i].loss_mask)]
        )
        columns["teacher_logp"] = (teacher, 0.0, torch.float32)
    layout = row_layout([len(ids) for ids in columns["input_ids"][0]], seq_len, packing)
    micro_batches = []
    for first in range(0, len(layout), rows_per_micro_batch):
        rows = layout[first : first + rows_per_micro_batch]
        micro_batch = MicroBatch(**build_rows(rows, columns))
        if "kept_counts" in columns:  # the ids in the order of the tokens they belong to
            ids = [torch.from_numpy(rollouts[i].kept_ids) for row in rows for u in row for i in units[u][0]]
            micro_batch.kept_ids = torch.cat(ids)
        micro_batches.append(micro_batch)
    while len(micro_batches) % num_micro_batches_multiple:
        empty = torch.zeros((1, 1), dtype=torch.long)  # (1, 1)
        micro_batches.append(
            MicroBatch(
                torch.full_like(empty, pad_token_id),
                empty.clone(),
                empty.bool(),
                empty.float(),
                empty.float(),
                torch.full_like(empty, -1),
            )
        )
    return micro_batches


def rank_shares(
    rollouts: list["Rollout"], world_size: int, budget_tokens: int, **packing
) -> list[tuple[list[MicroBatch], dict]]:
    """The step's rollouts as micro-batches (rl_micro_batches, with `packing`'s keywords), dealt to the ranks
    in turn, each with what the loss may normalise by, counted over the whole step and the same on every
    rank: loss tokens, rollouts, episodes (a forked episode's branches count once) and Dr. GRPO's
    budget_tokens."""
    micro_batches = rl_micro_batches(rollouts, num_micro_batches_multiple=world_size, **packing)
    counts = {
        "num_loss_tokens": sum(mb.num_loss_tokens() for mb in micro_batches),
        "num_rollouts": len(rollouts),
        "num_episodes": len({r.step_episode for r in rollouts}),
        "num_budget_tokens": budget_tokens,
    }
    return [(micro_batches[rank::world_size], counts) for rank in range(world_size)]


def pack_step(cfg, batch, world_size: int, tokenizer, kept_set: str, device: str):
    """rl.py's step (cfg: its Config; batch: the producer's StepBatch) packed: the rollouts it trains on and
    each rank's micro-batches."""
    from lib.log import say

    if batch.num_too_long:
        say(
            f"WARNING: dropped {batch.num_too_long} rollouts (whole groups) longer than seq_len {cfg.seq_len} "
            "(rollouts/too_long)"
        )
    # DAPO's overlong masking: rollouts cut by a token limit leave the step after their group's advantages,
    # so they carry no loss and count in no normaliser (as TRL's masking does).
    rollouts = [r for r in batch.rollouts if not (cfg.loss.mask_truncated and r.truncated)]
    assert kept_set != "served" or all(r.kept_counts is not None for r in rollouts), (
        "the producer lets no rollout without kept sets through"
    )
    shared = cfg.packing and cfg.model.attn_implementation == "sdpa" and device.startswith("cpu")
    # Dr. GRPO's budget: max_tokens is per turn, so a multi-turn rollout may hold more than its share.
    return rollouts, rank_shares(
        rollouts, world_size,
        budget_tokens=cfg.examples_per_step * cfg.rollouts_per_example * cfg.sampling.max_tokens,
        seq_len=cfg.seq_len, rows_per_micro_batch=cfg.micro_batch_size, pad_token_id=tokenizer.pad_token_id,
        packing=cfg.packing, share_prompts=cfg.share_prompts == "on" or (cfg.share_prompts == "auto" and shared),
    )  # fmt: skip
