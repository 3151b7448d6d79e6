"""The run log: metrics.jsonl across a resume, rl.py's console lines, samples and the end-of-run summary."""

import json

from lib.log import RunLog, rl_line, wrap


def metrics_lines(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_metrics_file_keeps_one_line_per_step_across_a_resume(tmp_path):
    log = RunLog(tmp_path, total_steps=4, start_step=0, enabled=True, print_every=1)
    log.evaluation(0, {"eval/reward": 0.1})
    for step in (1, 2, 3):
        if step == 2:  # rl.py evaluates a step before logging its metrics
            log.evaluation(2, {"eval/reward": 0.2})
        log.scalars(step, {"reward/mean": step / 10})
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as file:
        file.write('{"step": 4, "reward/me')  # killed while writing step 4
    # Resumed from checkpoint 2: step 3 and the half line go, and the resumed run's evaluation of its
    # starting weights joins step 2's line.
    log = RunLog(tmp_path, total_steps=4, start_step=2, enabled=True, print_every=1)
    log.evaluation(2, {"eval/reward": 0.25})
    log.scalars(3, {"reward/mean": 0.33})
    log.scalars(4, {"reward/mean": 0.44})
    log.close()
    assert metrics_lines(tmp_path) == [
        {"step": 0, "eval/reward": 0.1},
        {"step": 1, "reward/mean": 0.1},
        {"step": 2, "eval/reward": 0.25, "reward/mean": 0.2},
        {"step": 3, "reward/mean": 0.33},
        {"step": 4, "reward/mean": 0.44},
    ]


def test_rl_line_is_short_and_names_reward_change_speed_and_waits():
    step = {
        "reward/mean": 0.5,
        "reward/std": 0.1,
        "reward/a": 0.5,
        "env/a/reward/mean": 0.5,
        "env/a/groups": 4,
        **{f"train/metric_{i}": 0.1 for i in range(30)},
        "perf/tokens_per_second": 12345.0,
        "perf/rollout_tokens_per_second": 2345.0,
        "time/wait_rollouts": 0.8,
        "time/train": 0.3,
        "time/wait_sync": 0.02,
        "time/step": 1.2,
    }
    first, second = rl_line(step, None), rl_line({**step, "reward/mean": 0.45}, step)
    slow = {
        **step,
        "time/step": 113.7,
        "time/wait_rollouts": 99.6,
        "time/wait_sync": 10.4,
        "eval/seconds": 16.9,
    }
    assert len(f"step 1000/1000  {second}") <= 100, second  # one line of a terminal's 100 columns
    assert all(len(line) <= 100 for line in wrap("step 1000/1000", rl_line(slow, step).split("  ")))
    assert "reward 0.500" in first and "reward 0.450 (-0.050)" in second
    assert "1.2 s: rollouts 0.8, sync 0.0" in second
    assert "2.3k/12k tok/s sampled/trained" in second
    assert "a 0.500" not in first  # one environment: no per-environment rewards
    mixture = {**step, "env/b/groups": 0}  # b had no group this step: no reward of its own
    assert "a 0.500, b -" in rl_line(mixture, step)
    assert ", eval 16.9  " in rl_line({**step, "time/step": 17.2, "eval/seconds": 16.9}, step)


def test_a_step_line_counts_the_evaluation_its_step_waited_for(tmp_path, capsys):
    log = RunLog(tmp_path, total_steps=2, start_step=0, enabled=True, print_every=1, line=rl_line)
    step = {"reward/mean": 0.5, "perf/tokens_per_second": 1.0, "perf/rollout_tokens_per_second": 1.0}
    step |= {"time/wait_rollouts": 0.1, "time/wait_sync": 0.0, "time/step": 9.0}
    log.scalars(1, step)
    log.evaluation(2, {"eval/reward": 0.5, "eval/seconds": 8.5})  # rl.py evaluates, then logs the step
    log.scalars(2, step)
    log.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert "eval" not in lines[0] and "sync 0.0, eval 8.5  " in lines[1]


def test_a_sample_shows_the_last_turn_shortened_and_its_reward(tmp_path, capsys):
    log = RunLog(tmp_path, total_steps=5, start_step=0, enabled=True, print_every=1)
    messages = [
        {"role": "system", "content": "Reverse the text."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "tsrif"},
        {"role": "user", "content": "lorem ipsum " * 40},
        {"role": "assistant", "content": "muspi merol"},
    ]
    log.sample(5, messages=messages, reward=0.875)
    log.sample(5, messages=messages[:3], reward=1.0)  # one turn: no turn count
    log.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "sample at step 5, reward 0.875 (turn 2 of 2)"
    assert lines[1].startswith("  user: lorem ipsum lorem") and lines[1].endswith("…")
    assert len(lines[1]) <= 130  # the last user message alone, shortened
    assert lines[2] == "  completion: muspi merol"
    assert lines[3:] == ["sample at step 5, reward 1.000", "  user: first", "  completion: tsrif"]


def test_console_lines_stay_within_100_columns_and_numbers_read_as_rl_py_writes_them(
    tmp_path, capsys, monkeypatch
):
    log = RunLog(tmp_path, total_steps=2000, start_step=0, enabled=True, print_every=1)
    sft_step = {
        "train/loss": 0.51,
        "train/lr": 8e-3,
        "train/grad_norm": 0.31,
        "perf/tokens_per_second": 25130.0,
    }
    log.scalars(
        1000, {**sft_step, "perf/step_seconds": 0.15, **{f"train/metric_{i}": 0.1 for i in range(12)}}
    )
    log.evaluation(
        1000, {f"eval/{name}": 0.02079 for name in ("reward", "reward_std", "perfect_rate", "pass@2")}
    )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "tensorboard").write_text("")
    monkeypatch.setattr("sys.executable", str(tmp_path / "venv" / "bin" / "python"))
    log.summary([sft_step], "train/loss", tmp_path / "weights", tmp_path / "curve.png")
    log.close()
    out = capsys.readouterr().out
    assert all(len(line) <= 100 for line in out.splitlines() if str(tmp_path) not in line), out
    assert "tokens_per_second 25k" in out and "e+04" not in out
    assert "eval at step 1000  reward 0.02079" in out
    assert f"tensorboard: venv/bin/tensorboard --logdir {tmp_path / 'tb'}" in out


def test_the_summary_compares_the_means_of_the_first_and_last_tenth_of_the_steps(tmp_path, capsys):
    """A step's reward is one noisy value: comparing the first step with the last read a flat run as a fall
    (0.289 -> 0.198)."""
    log = RunLog(tmp_path, total_steps=30, start_step=10, enabled=True, print_every=100)
    rewards = [0.289, 0.211] + [0.25] * 16 + [0.302, 0.198]
    history = [{"reward/mean": reward, "perf/tokens_per_second": 1.0} for reward in rewards]
    for steps, expected in (
        (history, "reward/mean 0.250 -> 0.250 (means of steps 11-12 and 29-30)"),
        (history[:9], "reward/mean 0.289 -> 0.250 (steps 11 and 19)"),  # a tenth of fewer than 10: one step
    ):
        log.summary(steps, "reward/mean", tmp_path / "weights", tmp_path / "curve.png")
        assert expected in capsys.readouterr().out.splitlines()
    log.close()
