"""Atomic step directories, keep-last-K, the LoRA merge, and a full training-state round trip."""

import hashlib
import json
import os

import pytest
import torch

from lib.trainer.checkpoint import (
    atomic_dir,
    drop_newer,
    latest,
    load_checkpoint,
    prune,
    save_checkpoint,
    step_dirs,
)
from lib.trainer.servable import merge_lora, save_weights


def test_atomic_dir_appears_whole_or_not_at_all(tmp_path):
    final = tmp_path / "weights" / "step_3"
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as tmp:
            (tmp / "config.json").write_text("{}")
            assert not final.exists()  # a reader sees nothing while it is written
            raise RuntimeError("killed mid-write")
    assert not final.exists() and list(final.parent.iterdir()) == []
    with atomic_dir(final) as tmp:
        (tmp / "a").write_text("first")
    with atomic_dir(final) as tmp:  # the same step again (after a resume) replaces it
        (tmp / "b").write_text("second")
    assert [p.name for p in final.iterdir()] == ["b"]
    assert [p.name for p in final.parent.iterdir()] == ["step_3"]


def test_latest_and_prune_order_steps_numerically_and_skip_temporary_dirs(tmp_path):
    for name in ["step_9", "step_10", "step_2", ".tmp-step_11", "notes"]:
        (tmp_path / name).mkdir()
    assert [p.name for p in step_dirs(tmp_path)] == ["step_2", "step_9", "step_10"]
    assert latest(tmp_path).name == "step_10" and latest(tmp_path / "missing") is None
    prune(tmp_path, keep=2)
    assert [p.name for p in step_dirs(tmp_path)] == ["step_9", "step_10"]


def test_merge_lora_adds_scaled_low_rank_update_under_plain_names():
    base, lora_a, lora_b = torch.randn(6, 4), torch.randn(2, 4), torch.randn(6, 2)
    prefix = "base_model.model.model.layers.0.mlp.up_proj"
    state = {
        f"{prefix}.base_layer.weight": base,
        f"{prefix}.lora_A.default.weight": lora_a,
        f"{prefix}.lora_B.default.weight": lora_b,
        "base_model.model.model.norm.weight": torch.ones(4),
    }
    merged = merge_lora(state, {prefix: 0.5})
    assert sorted(merged) == ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    torch.testing.assert_close(merged["model.layers.0.mlp.up_proj.weight"], base + 0.5 * lora_b @ lora_a)


def test_training_state_round_trips_exactly(tmp_path):
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        model[0].weight.requires_grad_(False)  # frozen weights are not stored
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
        return model, optimizer, scheduler

    model, optimizer, scheduler = build()
    for _ in range(3):
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    path = save_checkpoint(tmp_path, 3, model, optimizer, scheduler, {"samples_seen": 12}, keep=1)
    assert "0.weight" not in torch.load(path / "model.pt")
    assert json.loads((path / "progress.json").read_text()) == {"step": 3, "samples_seen": 12}
    expected_next = torch.rand(3)

    restored, restored_optimizer, restored_scheduler = build()
    torch.manual_seed(123)  # different RNG: the checkpoint's must come back
    assert load_checkpoint(path, restored, restored_optimizer, restored_scheduler)["step"] == 3
    assert torch.equal(torch.rand(3), expected_next)
    for a, b in zip(model.state_dict().values(), restored.state_dict().values()):
        assert torch.equal(a, b)
    assert restored_scheduler.get_last_lr() == scheduler.get_last_lr()
    x = torch.randn(5, 4)
    for m, o in ((model, optimizer), (restored, restored_optimizer)):
        m(x).square().mean().backward()
        o.step()
    for a, b in zip(model.parameters(), restored.parameters()):
        assert torch.equal(a, b)  # same Adam moments, same step count
    save_checkpoint(tmp_path, 4, model, optimizer, scheduler, {}, keep=1)
    assert [p.name for p in step_dirs(tmp_path / "checkpoints")] == ["step_4"]


def small_training_state():
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def test_a_checkpoint_carries_a_manifest_of_its_files_sizes_and_hashes(tmp_path):
    path = save_checkpoint(tmp_path, 1, *small_training_state(), {}, keep=2)
    manifest = json.loads((path / "manifest.json").read_text())
    files = sorted(p.name for p in path.iterdir() if p.name != "manifest.json")
    assert sorted(manifest) == files == ["model.pt", "optimizer.pt", "progress.json", "state.pt"]
    for name, entry in manifest.items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("damage", ["truncated", "same size, other bytes", "missing"])
def test_latest_skips_a_damaged_checkpoint_with_one_line_and_takes_the_older_one(damage, tmp_path, capsys):
    """What a power loss can leave when the rename reached the disk before the data: latest() must not hand
    it to torch.load."""
    for step in (1, 2):
        save_checkpoint(tmp_path, step, *small_training_state(), {}, keep=2)
    capsys.readouterr()
    model_file = tmp_path / "checkpoints" / "step_2" / "model.pt"
    data = model_file.read_bytes()
    if damage == "truncated":
        model_file.write_bytes(data[: len(data) // 2])
    elif damage == "same size, other bytes":
        model_file.write_bytes(data[:-8] + bytes(8))
    else:
        model_file.unlink()
    assert latest(tmp_path / "checkpoints") == tmp_path / "checkpoints" / "step_1"
    (line,) = capsys.readouterr().out.splitlines()
    assert "step_2" in line and "model.pt" in line and "skipping" in line, line
    assert latest(tmp_path / "checkpoints" / "nothing here") is None


def test_files_and_directories_reach_the_disk_before_the_rename(tmp_path, monkeypatch):
    """A rename can reach the disk before the data it names (ext4, xfs): every file, the temporary
    directory and its parent are fsynced first, and the parent again after (the rename itself)."""
    events = []
    real_fsync, real_rename = os.fsync, os.rename
    monkeypatch.setattr(
        os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real_fsync(fd))
    )
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", str(a))), real_rename(a, b)))
    final = tmp_path / "weights" / "step_1"
    with atomic_dir(final) as tmp:
        (tmp / "config.json").write_text("{}")
        (tmp / "merged").mkdir()
        (tmp / "merged" / "model.safetensors").write_bytes(b"tensors")
    renamed = events.index(("rename", str(tmp)))
    synced_before = {path for kind, path in events[:renamed] if kind == "fsync"}
    assert synced_before >= {
        str(tmp / "config.json"),
        str(tmp / "merged" / "model.safetensors"),
        str(tmp / "merged"),
        str(tmp),
        str(final.parent),
    }, events
    assert ("fsync", str(final.parent)) in events[renamed + 1 :], events
    assert (final / "merged" / "model.safetensors").read_bytes() == b"tensors"


def test_a_rerun_from_step_0_keeps_what_it_writes_beside_a_dead_runs_higher_steps(tiny_dir, tmp_path):
    """A run killed before its first checkpoint left weights/step_3..5; the rerun starts at 0. Pruning keeps
    the newest `keep` steps up to the one just written; steps above it go only when the caller drops them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir)
    for step in (3, 4, 5):
        (tmp_path / "weights" / f"step_{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)

    def names(kind):
        return [p.name for p in step_dirs(tmp_path / kind)]

    path = save_weights(tmp_path, 0, model, tokenizer, torch.float32, keep=3)
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert names("weights") == ["step_0", "step_3", "step_4", "step_5"]
    for step in (1, 2, 3):  # step_3 is written again: the dead run's is replaced
        save_weights(tmp_path, step, model, tokenizer, torch.float32, keep=3)
    assert names("weights") == ["step_1", "step_2", "step_3", "step_4", "step_5"]
    assert (tmp_path / "weights" / "step_3" / "config.json").is_file()
    drop_newer(tmp_path / "weights", 3)
    assert names("weights") == ["step_1", "step_2", "step_3"]

    save_checkpoint(tmp_path, 0, *small_training_state(), {}, keep=1)
    assert names("checkpoints") == ["step_0", "step_3", "step_4", "step_5"]
    prune(tmp_path / "checkpoints", keep=1)  # without `written`: the newest `keep` of all, as before
    assert names("checkpoints") == ["step_5"]
