"""The algorithm recipes (configs/recipes/) and a custom loss, each 2 steps end to end on the tiny model
against one shared builtin server."""

import json

import pytest
import torch
from conftest import ROOT
from safetensors.torch import load_file
from test_rl import learned, rl, rl_config, server  # noqa: F401  (server: the module's one builtin server)

RECIPES = ROOT / "configs" / "recipes"
# Short runs: 2 groups of 4 a step, at most 24 tokens a reply.
SMALL = ("--examples-per-step", "2", "--sampling.max-tokens", "24")


def moved(run, tiny_dir) -> bool:
    """Whether the run's last weights differ from the tiny model's."""
    trained, start = (
        load_file(run / "weights" / "step_2" / "model.safetensors"),
        load_file(tiny_dir / "model.safetensors"),
    )
    return any(not torch.equal(trained[name], start[name]) for name in start)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["dppo", "grpo", "dr_grpo", "gspo", "cispo", "trl"])
def test_each_recipe_runs_two_steps_and_trains(recipe, tiny_dir, server, tmp_path):  # noqa: F811
    # Each recipe over the tiny preset, which sets GSPO's: a recipe sets every field it relies on. On policy:
    # a step sampled one update behind (max_async_level 1) learns nothing when the clip drops all of its
    # rollouts, as GSPO's 3e-4 / 4e-4 clip did to the 4 rollouts of a step's one varied group.
    recipe_args = ("@", str(RECIPES / f"{recipe}.toml"), "--max-async-level", "0", *SMALL)
    cfg = rl_config(tiny_dir, tmp_path / "run", server.url, *recipe_args)
    expected = {
        "dppo": ("dppo", "token", "token_mean", "none"),
        "grpo": ("ppo", "token", "sequence_mean", "group"),
        "dr_grpo": ("ppo", "token", "constant", "none"),
        "gspo": ("ppo", "sequence", "sequence_mean", "group"),
        "cispo": ("cispo", "token", "token_mean", "group"),
        "trl": ("ppo", "token", "token_mean", "group"),
    }[recipe]
    loss = cfg.loss
    assert (loss.variant, loss.ratio_level, loss.aggregation, cfg.advantage.normalize) == expected
    history = rl.main(cfg)["history"]
    assert len(history) == 2
    trained = [m for m in history if m["train/rollouts"]]
    assert trained and all(learned(m) and m["train/episodes"] == m["train/rollouts"] for m in trained)
    assert moved(tmp_path / "run", tiny_dir)


def test_dapo_masks_the_rollouts_that_seq_len_cut(tiny_dir, server, tmp_path):  # noqa: F811
    # max_tokens far above seq_len: each request asks for what seq_len leaves after its prompt, so every cut
    # reply ended at seq_len; the untrained model stops on its own now and then.
    flags = ("--sampling.max-tokens", "512", "--seq-len", "40", "--examples-per-step", "2")
    cfg = rl_config(tiny_dir, tmp_path / "run", server.url, "@", str(RECIPES / "dapo.toml"), *flags)
    assert cfg.loss.mask_truncated and cfg.filter_flat_groups and cfg.loss.clip_high == 0.28
    history = rl.main(cfg)["history"]
    num_cut = 0
    for step, metrics in enumerate(history, 1):
        groups = {}  # the step's groups (one task each), as rollouts/step_N.jsonl records them
        for line in (tmp_path / "run" / f"rollouts/step_{step}.jsonl").open():
            record = json.loads(line)
            groups.setdefault(record["task_id"], []).append(record)
        trained = [r for group in groups.values() if len({r["reward"] for r in group}) > 1 for r in group]
        cut = ["length" in r["finish_reasons"] for r in trained]
        assert metrics["train/truncated_masked"] == sum(cut) and metrics["train/rollouts"] == cut.count(False)
        assert metrics["rollouts/truncated"] >= sum(cut)  # every sampled rollout, flat groups' included
        num_cut += sum(cut)
    assert num_cut > 0, "no trained reply reached seq_len"


def test_a_custom_loss_by_import_path_is_called_with_the_step_and_trains(tiny_dir, server, tmp_path):  # noqa: F811
    from custom_loss import CALLS

    CALLS.clear()
    flags = ("--loss.import-path", "custom_loss:reinforce_token_mean", "--max-async-level", "0", *SMALL)
    history = rl.main(rl_config(tiny_dir, tmp_path / "run", server.url, *flags))["history"]
    assert [m["train/custom_calls"] for m in history if m["train/rollouts"]] and CALLS
    # One call per micro-batch; a step whose groups were all flat trains nothing and has no custom metric.
    assert sum(m.get("train/custom_calls", 0) for m in history) == len(CALLS)
    assert {call["num_rollouts"] for call in CALLS} <= {m["train/rollouts"] for m in history}
    assert all(
        call["rollout_index"].shape[0] == call["rows"] and call["num_budget_tokens"] == 2 * 4 * 24
        for call in CALLS
    )
    assert "train/importance_ratio" not in history[0]  # the built-in loss never ran
    assert moved(tmp_path / "run", tiny_dir)
