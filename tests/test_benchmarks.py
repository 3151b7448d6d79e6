"""The benchmarks: grouped as lib/ is, each imports lib/, benchmarks/common.py and its own group's scripts only;
a benchmark never deletes a directory it did not write."""

import ast
import importlib.util
import json
import sys

import pytest
from conftest import ROOT


def load_benchmark(path: str):
    """Imports benchmarks/<path> as a module (benchmarks are scripts, not a package's modules)."""
    name = "plainrl_benchmark_" + path.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_benchmark_imports_no_test_and_no_other_groups_script():
    files = sorted((ROOT / "benchmarks").rglob("*.py"))
    group_of = {path.stem: path.parent.name for path in files if path.parent.name != "benchmarks"}
    wrong = []
    for path in files:
        group = path.parent.name if path.parent.name != "benchmarks" else None
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] in ("tests", "conftest"):
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
                elif parts[0] == "benchmarks" and len(parts) > 2 and parts[1] not in ("common", group):
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}, another group's")
                elif parts[0] in group_of and group_of[parts[0]] != group:
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}, another group's")
        if '"tests"' in path.read_text():
            wrong.append(f"{path.relative_to(ROOT)} names the tests' folder")
    assert wrong == []
    assert set(group_of.values()) == {"trainer", "rl", "inference", "gpu"}
    assert not [path for path in (ROOT / "benchmarks").glob("*.py") if path.stem.startswith("bench_")]


def demo_rl_refusal(tmp_path, monkeypatch, capsys, out) -> str:
    """bench_demo_rl.py's main() on `out` with work of any kind forbidden: the one line it ends on (exit 2)."""
    sft = tmp_path / "sft"
    sft.mkdir(exist_ok=True)
    (sft / "config.json").write_text("{}")
    bench = load_benchmark("rl/bench_demo_rl.py")

    def work(*args, **kwargs):
        raise AssertionError("the benchmark began its work before judging --out")

    monkeypatch.setattr(bench.demo, "evaluate", work)
    monkeypatch.setattr(bench.demo, "run", work)
    monkeypatch.setattr(sys, "argv", ["bench_demo_rl.py", "--sft", str(sft), "--out", str(out)])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and error.count("\n") == 1, error
    return error


def test_bench_demo_rl_refuses_an_out_holding_files_it_did_not_write_and_keeps_them(
    tmp_path, monkeypatch, capsys
):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    error = demo_rl_refusal(tmp_path, monkeypatch, capsys, out)
    assert "notes.txt" in error and str(out) in error
    assert (out / "notes.txt").read_text() == "mine"

    # Its record beside them does not make the folder its own: it holds more than the benchmark writes.
    (out / "bench_demo_rl.json").write_text(json.dumps({"written_by": "bench_demo_rl.py"}))
    demo_rl_refusal(tmp_path, monkeypatch, capsys, out)
    assert (out / "notes.txt").read_text() == "mine"


def test_bench_demo_rl_refuses_the_demo_it_starts_from(tmp_path, monkeypatch, capsys):
    demo = tmp_path / "demo"
    weights = demo / "sft" / "weights" / "step_10"
    weights.mkdir(parents=True)
    (weights / "config.json").write_text("{}")
    (demo / "demo.toml").write_text("seed = 0\n")
    monkeypatch.setattr(sys, "argv", ["bench_demo_rl.py", "--sft", str(weights), "--out", str(demo)])
    bench = load_benchmark("rl/bench_demo_rl.py")
    monkeypatch.setattr(bench.demo, "evaluate", lambda *a, **k: pytest.fail("evaluated"))
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2 and (weights / "config.json").is_file() and (demo / "demo.toml").is_file()
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize(
    "path", ["inference/bench_generation.py", "inference/bench_decode_step.py", "trainer/bench_limits.py"]
)
def test_a_model_benchmark_without_its_model_says_how_to_make_it_in_one_sentence(
    path, tmp_path, monkeypatch, capsys
):
    missing = tmp_path / "outputs" / "models" / "smollm2-135m-instruct"  # where their default lies, unmade
    monkeypatch.setattr(sys, "argv", [path, "--model", str(missing)])
    bench = load_benchmark(path)
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and error.count("\n") == 1 and "run `make smollm2` to create it" in error


def test_bench_demo_rl_starts_its_own_earlier_output_over(tmp_path, monkeypatch):
    sft, out = tmp_path / "sft", tmp_path / "bench"
    sft.mkdir()
    (sft / "config.json").write_text("{}")
    bench = load_benchmark("rl/bench_demo_rl.py")
    began = []
    monkeypatch.setattr(bench.demo, "evaluate", lambda cfg, model, run_dir: began.append(run_dir))
    monkeypatch.setattr(bench.demo, "run", lambda *args: pytest.fail("RL ran"))
    monkeypatch.setattr(sys, "argv", ["bench_demo_rl.py", "--sft", str(sft), "--out", str(out)])
    with pytest.raises(pytest.fail.Exception):
        bench.main()  # a new folder: the benchmark writes its record there, then begins
    record = json.loads((out / "bench_demo_rl.json").read_text())
    assert began == [out / "eval" / "before-rl"] and record["sft"] == str(sft)
    (out / "eval" / "before-rl").mkdir(parents=True)
    (out / "rl" / "weights").mkdir(parents=True)
    with pytest.raises(pytest.fail.Exception):
        bench.main()  # its own earlier output: what it wrote goes, the record stays
    assert sorted(p.name for p in out.iterdir()) == ["bench_demo_rl.json"]


def test_gather_gpu_wheels_refuses_a_folder_it_did_not_write_and_removes_no_wheel_there(
    tmp_path, monkeypatch, capsys
):
    out = tmp_path / "wheels"
    out.mkdir()
    (out / "mine-1.0-py3-none-any.whl").write_bytes(b"a wheel of the user's")
    gather = load_benchmark("gpu/gather_gpu_wheels.py")
    monkeypatch.setattr(gather, "gather", lambda out: pytest.fail("gathered into a folder of someone else's"))
    monkeypatch.setattr(sys, "argv", ["gather_gpu_wheels.py", "--out", str(out)])
    with pytest.raises(SystemExit) as exit_:
        gather.main()
    assert exit_.value.code == 2 and (out / "mine-1.0-py3-none-any.whl").is_file()
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "mine-1.0-py3-none-any.whl" in error


def write_evaluation(run_dir, values: list[float]) -> None:
    """An evaluation eval.py could have written, sampled and greedy alike: one reward per problem."""
    for into in (run_dir, run_dir.with_name(run_dir.name + "-greedy")):
        into.mkdir(parents=True)
        lines = [json.dumps({"task_id": f"t{i}", "rollout": 0, "reward": r}) for i, r in enumerate(values)]
        (into / "results.jsonl").write_text("\n".join(lines) + "\n")
        (into / "summary.json").write_text(
            json.dumps({"status": "ok", "avg_reward": sum(values) / len(values)})
        )


def test_reasoning_gym_table_gives_paired_gains_in_standard_errors_and_counts_those_over_their_bar(
    tmp_path, capsys, monkeypatch
):
    """The table's line for a task from its evaluations' records: rewards, each gain with its size in standard
    errors of the paired differences, "-" where an evaluation is missing; the tally counts a gain over its bar."""
    bench = load_benchmark("rl/reasoning_gym_table.py")
    out = tmp_path / "gcd"
    rewards = {  # per problem: the base never scores, SFT gets half, RL two more in ten
        "base": [0.0] * 40,
        "after-sft": [float(i % 2) for i in range(40)],
        "after-rl": [float(i % 2 or i % 10 in (2, 4)) for i in range(40)],
    }
    for name, values in rewards.items():
        write_evaluation(out / "eval" / name, values)
    (out / "inputs.json").write_text(json.dumps({"minutes": {"sft": 2.5, "rl": 3.0, "eval base": 1.5}}))
    monkeypatch.setattr(
        sys, "argv", ["reasoning_gym_table.py", "--table", "--tasks", "gcd", "--out", str(tmp_path)]
    )
    bench.main()
    printed = capsys.readouterr().out
    [line] = [line for line in printed.splitlines() if line.startswith("| `gcd`")]
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells[1:5] == ["0.000 (0.000)", "0.500 (0.500)", "0.700 (0.700)", "-"]
    # SFT+RL - base: mean 0.7, sd of the differences sqrt(0.7 * 0.3 * 40 / 39): 9.5 standard errors.
    assert cells[5].startswith("+0.700 (+9.5)") and cells[6].startswith("+0.200 (+3.1)") and cells[7] == "-"
    assert cells[8] == "2.5/3.0/-, evals 1.5"
    assert "after-rl - base > 4 se: 1, after-rl - after-sft > 2 se: 1" in printed
    # With a longer RL run asked for and not made yet: its reward, its gain and its minutes are "-".
    monkeypatch.setattr(sys, "argv", [*sys.argv, "--more-rl-steps", "40"])
    bench.main()
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| `gcd`")]
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells[5] == "-" and cells[9] == "-" and cells[10] == "2.5/3.0/-/-, evals 1.5"


def test_distill_vs_rl_scores_only_the_best_runs_curve_and_judges_both_targets(tmp_path, capsys, monkeypatch):
    """Every run is scored at its last step; only the best learning rate of each method and start also every
    --eval-every steps. The tables and the two targets from made-up evaluation records."""
    bench = load_benchmark("rl/distill_vs_rl.py")
    out, demo_dir = tmp_path / "out", tmp_path / "demo"
    flags = ["--out", str(out), "--demo", str(demo_dir), "--steps", "60", "--eval-every", "20"]
    flags += ["--distill-lrs", "1e-5", "3e-5", "--rl-lrs", "3e-5"]
    monkeypatch.setattr(sys, "argv", ["distill_vs_rl.py", "--table", *flags])

    def share(reward: float) -> list[float]:  # 40 problems, that share of them right
        return [float(i < reward * 40) for i in range(40)]

    evaluations = {
        "teacher": 0.5,
        "start-sft": 0.3,
        "start-base": 0.05,
        "sft-distill-lr1e-5/step_60": 0.4,
        "sft-distill-lr3e-5/step_20": 0.475,  # the teacher's - 0.05 = 0.45 by step 20
        "sft-distill-lr3e-5/step_40": 0.5,
        "sft-distill-lr3e-5/step_60": 0.5,
        "sft-rl-lr3e-5/step_20": 0.35,
        "sft-rl-lr3e-5/step_40": 0.425,
        "sft-rl-lr3e-5/step_60": 0.475,  # RL by step 60: distillation in a third of its steps
        "base-distill-lr1e-5/step_60": 0.2,
        "base-distill-lr3e-5/step_60": 0.4,
        "base-rl-lr3e-5/step_60": 0.1,
    }
    for name, reward in evaluations.items():
        write_evaluation(out / "eval" / name, share(reward))
    (out / "sft" / "distill-lr3e-5").mkdir(parents=True)
    steps = [json.dumps({"step": step, "time/step": 6.0}) for step in range(1, 61)]
    (out / "sft" / "distill-lr3e-5" / "metrics.jsonl").write_text("\n".join(steps) + "\n")
    bench.main()
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("| distill, lr 3e-5 (best)"))
    assert [cell.strip() for cell in row.strip("|").split("|")][1:] == [
        "0.300 (0.300)", "0.475 (0.475)", "0.500 (0.500)", "0.500 (0.500)", "6.0"
    ]  # fmt: skip
    assert "| distill, lr 1e-5 | 0.300 (0.300) | - | - | 0.400 (0.400) | - |" in printed
    assert "distillation at step 20, 2.0 min, RL at step 60" in printed and ": met (distillation" in printed
    # From the base model at step 60: 0.4 - 0.1 over 40 problems, 12 right only after distillation.
    assert "distillation - RL: +0.300 +- 0.073 (+4.1 se): met" in printed

    # The stages: the best runs' curves are scored, the other learning rate's last step only.
    for weights in (demo_dir / "rl" / "weights" / "step_60", demo_dir / "sft" / "weights" / "step_100"):
        weights.mkdir(parents=True)
        (weights / "config.json").write_text("{}")
    demo = bench.load_script("demo")
    cfg = demo.resolved(demo.Config(out=demo_dir))
    args = type("Args", (), {"out": out, "demo": demo_dir, "steps": 60, "eval_every": 20, "seed": 0})
    args.starts = ["sft", "base"]
    args.distill_lrs, args.rl_lrs = ["1e-5", "3e-5"], ["3e-5"]
    names = [stage.name for stage in bench.stages(demo, args, cfg, curves=True)]
    assert "eval sft-distill-lr3e-5 step 20" in names and "eval base-rl-lr3e-5 step 40" in names
    assert "eval sft-distill-lr1e-5" in names and "eval sft-distill-lr1e-5 step 20" not in names
    first = bench.stages(demo, args, cfg, curves=False)
    assert not [stage.name for stage in first if " step " in stage.name]
    settings = {stage.name: stage.settings[0] for stage in first if stage.name.startswith("sft-")}
    distill, rl = settings["sft-distill-lr3e-5"], settings["sft-rl-lr3e-5"]
    assert (
        distill["teacher"]["model"] == str(demo_dir / "rl" / "weights" / "step_60")
        and not rl["teacher"]["model"]
    )
    # The weights of steps 20, 40 and 60 outlive the run, for the curve of whichever learning rate is best.
    assert (
        distill["checkpoint_every"] == 20 and distill["keep_weights"] >= 3 and distill["optim"]["lr"] == 3e-5
    )
