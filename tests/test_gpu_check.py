"""benchmarks/gpu/gpu_check.py on CPU at the 2-layer Qwen3 shape: it runs every section and writes every figure
the GPU run writes (the CUDA-only ones null), so the check cannot rot between the rare runs on a GPU."""

import importlib.metadata
import json
import subprocess
import sys

import pytest
from conftest import ROOT

from benchmarks.gpu import gpu_check


def test_a_torch_that_lacks_an_api_plainrl_calls_stops_the_check_in_one_sentence(monkeypatch):
    from torch.nn.attention import varlen

    assert gpu_check.missing_torch_apis() == []
    assert gpu_check.torch_problem() is None

    def varlen_attn_of_torch_2_11(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        *,
        return_aux=None,
        scale=None,
        window_size=(-1, -1),
    ):
        """torch 2.11.0's signature (the GPU machines' torch): no enable_gqa, which lib/models/attention.py does without."""

    def varlen_attn_without_a_window(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
        """An older signature: no causal window."""

    monkeypatch.setattr(varlen, "varlen_attn", varlen_attn_of_torch_2_11)
    assert gpu_check.missing_torch_apis() == []
    monkeypatch.setattr(varlen, "varlen_attn", varlen_attn_without_a_window)
    assert gpu_check.missing_torch_apis() == [
        "torch.nn.attention.varlen.varlen_attn(window_size=) (lib/models/attention.py)"
    ]
    sentence = gpu_check.torch_problem()
    assert "varlen_attn(window_size=)" in sentence and sentence.count(". ") == 0 and sentence.endswith(".")


def test_a_carried_wheel_whose_requirement_the_machine_does_not_meet_is_named(tmp_path, monkeypatch):
    assert gpu_check.requirement_problems() == []  # this venv: the lock's versions
    dist_info = tmp_path / "carried-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: carried\nVersion: 1.0\nRequires-Dist: numpy<2\n"
        "Requires-Dist: not-on-this-machine\nRequires-Dist: pytest; extra == 'test'\n"
    )
    monkeypatch.setenv(gpu_check.SITE_VARIABLE, str(tmp_path))
    numpy_version = importlib.metadata.version("numpy")
    assert gpu_check.requirement_problems() == [
        "carried needs not-on-this-machine, which is missing",
        f"carried needs numpy<2, found {numpy_version}",
    ]


@pytest.mark.slow
def test_the_cpu_run_writes_every_figure_of_the_gpu_run_with_the_cuda_only_ones_null(tmp_path):
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu" / "gpu_check.py"),
        "--device",
        "cpu",
        "--shape",
        "test",
    ]
    done = subprocess.run([*command, "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results["errors"] == {}
    assert set(results) == {*gpu_check.FIGURES, "errors"}
    assert all(
        set(names) <= set(gpu_check.FIGURES[section]) for section, names in gpu_check.CUDA_ONLY.items()
    )
    for section, figures in gpu_check.FIGURES.items():
        assert list(results[section]) == list(figures), section
        for figure in figures:
            value, cuda_only = results[section][figure], figure in gpu_check.CUDA_ONLY.get(section, ())
            assert (value is None) == cuda_only, f"{section}.{figure} is {value!r} on CPU"

    run, model = results["run"], results["model"]
    assert run["requirement_problems"] == [] and run["packages"]["torch"].startswith("2.13")
    assert model["layers"] == 2 and 9e6 < model["parameters"] < 11e6  # mostly the 151,936 x 64 embedding
    for section in ("trainer_sft", "trainer_rl", "sft", "lora"):
        assert results[section]["tokens_per_second"] > 0, section
    assert results["head"]["logp_max_difference"] < 1e-4  # float32: the chunks compute the same logprobs
    fsdp2 = results["fsdp2"]
    assert fsdp2["backend"] == "gloo" and fsdp2["sharded_parameters"] > 0 and fsdp2["full_state_tensors"] > 0
    assert 0 < results["lora"]["trained_parameters"] < model["parameters"] / 100
    rl = results["rl"]
    assert rl["steps"] == 3 and len(rl["sync_seconds"]) == 3 and rl["rollout_tokens_per_second"] > 0
    # The run's start and each of its 3 steps: the server reported the new label, the probe agreed.
    assert rl["weight_checks"].startswith("4/4") and len(rl["probe_differences"]) == 4
    assert max(rl["probe_differences"]) < rl["probe_tolerance"] == 1e-3

    table = (tmp_path / "gpu_check.md").read_text()
    assert table.count("\n") == 2 + sum(len(figures) for figures in gpu_check.FIGURES.values())
    assert "| trainer_rl | tokens_per_second |" in table and "| 11.9k |" in table and "| 16.8% |" in table
