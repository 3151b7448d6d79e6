"""Mixtures of environments: the draws by ratio, their resume, the config round trip, and rl.py's
per-environment metrics and evaluations on the tiny model."""

import json
import os
import subprocess

import pytest
from conftest import ROOT, load_script, tensorboard_scalars, wandb_history

from lib.config import UserError, parse, write_config
from lib.inference import launch
from lib.orchestrator.mixture import Mixture, Source
from lib.orchestrator.tasks import EnvConfig, env_configs

rl = load_script("rl")

MIX = [
    '{"id": "alphabet_sort", "ratio": 3, "args": {"max_turns": 2}}',
    '{"id": "plainrl_calculator", "num_examples": 50}',
]


def two_sources(ratio_a=3.0, ratio_b=1.0) -> list[Source]:
    return [
        Source("a", None, [f"a{i}" for i in range(10_000)], ratio_a),
        Source("b", None, [f"b{i}" for i in range(10_000)], ratio_b),
    ]


def test_a_3_to_1_mixture_draws_each_environment_within_4_sigma_of_its_share():
    mixture, draws = Mixture(two_sources(), seed=7), 4000
    tasks = [mixture.draw()[1] for _ in range(draws)]
    from_a = sum(task.startswith("a") for task in tasks)
    # Binomial(4000, 3/4): mean 3000, sigma sqrt(4000 * 3/4 * 1/4) = 27.4; 4 sigma fails once in ~16,000 seeds.
    sigma = (draws * 0.75 * 0.25) ** 0.5
    assert abs(from_a - 0.75 * draws) < 4 * sigma, from_a
    # Each environment plays its own tasks in order, one counter each.
    assert [t for t in tasks if t.startswith("b")] == [f"b{i}" for i in range(draws - from_a)]
    assert mixture.state() == {"task_index": draws, "env_tasks": {"a": from_a, "b": draws - from_a}}


def test_the_draws_are_a_function_of_seed_and_index_and_a_restored_mixture_continues_them():
    whole = Mixture(two_sources(), seed=3)
    sequence = [whole.draw()[1] for _ in range(300)]
    first = Mixture(two_sources(), seed=3)
    before = [first.draw()[1] for _ in range(120)]
    resumed = Mixture(two_sources(), seed=3)
    resumed.restore(json.loads(json.dumps(first.state())), 0)  # through a checkpoint's JSON
    assert before + [resumed.draw()[1] for _ in range(180)] == sequence
    other_seed = Mixture(two_sources(), seed=4)
    assert [other_seed.draw()[1] for _ in range(300)] != sequence


def test_a_checkpoint_from_before_mixtures_resumes_its_single_environment_counter():
    mixture = Mixture([Source("only", None, list(range(100)))])
    mixture.restore({"step": 3, "task_index": 24}, 0)
    assert mixture.draw() == (mixture.sources[0], 24)
    mixture.restore({"step": 3}, 3 * 8)  # older still: one step's worth of tasks per step
    assert mixture.draw()[1] == 24


def test_a_mixture_round_trips_through_a_preset_the_cli_and_the_written_config(tmp_path):
    preset = tmp_path / "mix.toml"
    preset.write_text(f'[env]\nid = "reverse_text"\nratio = 2\nmix = {json.dumps(MIX)}\n')
    from_preset = parse(rl.Config, ["@", str(preset)])
    from_cli = parse(rl.Config, ["--env.id", "reverse_text", "--env.ratio", "2", "--env.mix", *MIX])
    assert from_preset == from_cli and from_preset.env.mix == tuple(MIX)
    write_config(from_preset, tmp_path / "config.toml")
    assert parse(rl.Config, ["@", str(tmp_path / "config.toml")]) == from_preset
    # A single environment writes an empty mix, which reads back as one environment.
    write_config(parse(rl.Config, []), tmp_path / "single.toml")
    assert parse(rl.Config, ["@", str(tmp_path / "single.toml")]).env.mix == ()

    configs = env_configs(from_preset.env)
    assert [(c.id, c.ratio, c.kwargs, c.num_examples) for c in configs] == [
        ("reverse_text", 2, {}, -1),
        ("alphabet_sort", 3, {"max_turns": 2}, -1),
        ("plainrl_calculator", 1.0, {}, 50),
    ]


@pytest.mark.parametrize(
    "mix, message",
    [
        (['{"id": "reverse_text"}'], "need different ids"),
        (['{"ratio": 2}'], "needs an id"),
        (['{"id": "alphabet_sort", "turns": 2}'], "takes only id, args"),
        (['{"id": "alphabet_sort", "args": "x"}'], "args must be a JSON object"),
        (["[1]"], "must be a JSON object"),
        (['{"id": "alphabet_sort", "ratio": 0}'], "ratio must be positive"),
        (['{"id": "alphabet_sort", "ratio": "2"}'], "ratio a number"),
        (['{"id": 3}'], "id must be a string"),
    ],
)
def test_a_bad_mixture_entry_is_one_sentence_before_any_heavy_work(mix, message):
    with pytest.raises(UserError, match=message):
        EnvConfig(mix=tuple(mix))


def test_sft_data_of_a_mixture_holds_each_environments_conversations():
    from lib.orchestrator.data import load_conversations

    mix = ('{"id": "alphabet_sort", "num_examples": 2}', '{"id": "plainrl_calculator", "num_examples": 4}')
    conversations = load_conversations(EnvConfig(id="reverse_text", num_examples=3, mix=mix))
    assert len(conversations) == 3 + 2 + 4
    systems = [c[0]["content"] if isinstance(c, list) else c["messages"][0]["content"] for c in conversations]
    assert systems[0].startswith("Reverse the text") and systems[0] != systems[3] != systems[-1]
    assert (
        isinstance(conversations[-1], dict) and conversations[-1]["tools"]
    )  # the calculator offers its tool


# ---------------------------------------------------------------- rl.py on the tiny model


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    with launch.running_server(
        str(tiny_dir), engine="torch", weights_root=root, log_path=root / "serve.log"
    ) as s:
        yield s


def mixture_run(model, out, url, *extra):
    """A short run on a 3:1 mixture of letter_taskset and reverse_text (both rewards vary for the tiny model)."""
    flags = ["@", str(ROOT / "configs/tiny/rl.toml"), "--model.name", str(model), "--output-dir", str(out)]
    flags += ["--inference.urls", url, "--env.id", "letter_taskset", "--env.ratio", "3"]
    flags += [
        "--env.mix",
        '{"id": "reverse_text", "num_examples": 16}',
    ]
    flags += ["--examples-per-step", "4", "--rollouts-per-example", "4", "--sampling.max-tokens", "24"]
    return rl.main(parse(rl.Config, [*flags, *extra]))


def trained_draws(out, step) -> list[tuple[str, str]]:
    """(environment, task id) of each group the run trained on at `step`, sorted."""
    records = [json.loads(line) for line in (out / "rollouts" / f"step_{step}.jsonl").open()]
    return sorted({(r["env"], r["task_id"]) for r in records})


@pytest.mark.slow
def test_kill_9_and_resume_continue_an_uninterrupted_runs_draw_sequence_past_the_groups_in_flight(
    tiny_dir, tmp_path
):
    from test_rl import FIXTURES, kill_at_step_6_then_resume, own_server_command

    from lib.orchestrator.envs import load_env, load_tasks
    from lib.orchestrator.tasks import task_id

    reverse = '{"id": "reverse_text", "num_examples": 16}'
    flags = ("--steps", "40", "--checkpoint-every", "4", "--max-async-level", "0", "--env.ratio", "3")
    out = tmp_path / "run"
    command = own_server_command(tiny_dir, out, *flags, "--env.mix", reverse)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{FIXTURES}"}
    kill_at_step_6_then_resume(command, tmp_path, out, env)

    # The sequence any run of this mixture follows: draw i's environment by (seed 0, i) alone, then that
    # environment's next task (finite tasksets cycle).
    config = EnvConfig(id="reverse_text", num_examples=16)
    tasks = {
        "letter_taskset": [f"letter-{i}" for i in range(16)],
        "reverse_text": [task_id(t.data) for t in load_tasks(load_env(config), config)],
    }
    sequence = Mixture([Source(name, None, ids) for name, ids in tasks.items()])
    sequence.sources[0].ratio = 3.0
    saved = json.loads((out / "checkpoints" / "step_4" / "progress.json").read_text())
    sequence.restore(saved, 0)
    assert 8 <= saved["task_index"] <= 10 and sum(saved["env_tasks"].values()) == saved["task_index"]
    for step in (5, 6, 7, 8):  # on-policy, 2 groups a step: the resumed run's step n plays the next 2 draws
        draws = [sequence.draw() for _ in range(2)]
        expected = sorted((source.name, task) for source, task in draws)
        assert trained_draws(out, step) == expected, step
    # An uninterrupted run of the same command follows the same sequence from its first draw: the resumed
    # run is that sequence, less the groups that were in flight at the kill (skipped, never replayed).
    whole = tmp_path / "whole"
    command = own_server_command(tiny_dir, whole, *flags, "--env.mix", reverse)
    command[command.index("40")] = "8"  # --steps
    subprocess.run(command, cwd=tmp_path, check=True, capture_output=True, env=env, timeout=600)
    sequence = Mixture([Source(name, None, ids) for name, ids in tasks.items()])
    sequence.sources[0].ratio = 3.0
    for step in range(1, 9):
        expected = sorted((source.name, task) for source, task in (sequence.draw() for _ in range(2)))
        assert trained_draws(whole, step) == expected, step
        if step <= 4:
            assert trained_draws(out, step) == expected, step  # the killed run's first 4 steps


@pytest.mark.slow
def test_a_mixture_logs_reward_flat_groups_errors_tokens_and_evaluations_per_environment(
    tiny_dir, server, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    evaluation = ("--eval.every", "2", "--eval.num-examples", "4", "--eval.rollouts-per-example", "2")
    wandb = ("--wandb.project", "p", "--wandb.name", "n", "--wandb.offline")
    mixture_run(tiny_dir, out, server.url, "--steps", "3", *evaluation, *wandb)

    scalars = tensorboard_scalars(out)
    for env in ("letter_taskset", "reverse_text"):
        for name in ("reward", "reward_greedy", "pass@2", "errors", "seconds"):
            assert scalars[f"eval/{env}/{name}"].keys() == {0, 2, 3}, (env, name)
        assert (out / "eval" / env / "step_2" / "sampled.jsonl").is_file()
    groups = {
        step: sum(scalars[f"env/{env}/groups"].get(step, 0) for env in ("letter_taskset", "reverse_text"))
        for step in (1, 2, 3)
    }
    assert groups == {1: 4, 2: 4, 3: 4}
    for env in ("letter_taskset", "reverse_text"):
        for name in ("flat_groups", "errors", "tokens"):
            assert scalars[f"env/{env}/{name}"].keys() == {1, 2, 3}, (env, name)
    rewards = [
        v
        for env in ("letter_taskset", "reverse_text")
        for v in scalars.get(f"env/{env}/reward/mean", {}).values()
    ]
    assert rewards and all(0 <= v <= 1 for v in rewards)
    for step in (1, 2, 3):  # each environment's reward is the mean of its rollouts in the step's records
        records = [json.loads(line) for line in (out / "rollouts" / f"step_{step}.jsonl").open()]
        for env in ("letter_taskset", "reverse_text"):
            mine = [r["reward"] for r in records if r["env"] == env]
            logged = scalars.get(f"env/{env}/reward/mean", {}).get(step)
            assert (logged is None) == (not mine), (step, env)
            if mine:
                assert logged == pytest.approx(sum(mine) / len(mine), rel=1e-5), (step, env)
    assert sum(scalars["env/letter_taskset/tokens"].values()) > 0
    logged = wandb_history(out)
    assert set(logged) == set(scalars)
    # The console's step lines give each environment's reward by name.
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert steps and all("letter_taskset " in line and "reverse_text " in line for line in steps)
    for tag, steps in scalars.items():
        assert logged[tag] == pytest.approx(steps, rel=1e-6), tag


def test_with_the_filter_a_resume_continues_the_draws_from_the_saved_counters(tiny_dir, server, tmp_path):
    """toy_taskset's groups are all flat for the untrained model (it never shouts the word back), so the
    filter replaces them and the draws run ahead of steps x examples; the resumed run's draws must
    continue from the checkpoint's counters, not from that estimate or from zero."""
    out = tmp_path / "run"
    flags = ["@", str(ROOT / "configs/tiny/rl.toml"), "--model.name", str(tiny_dir), "--output-dir", str(out)]
    flags += [
        "--inference.urls",
        server.url,
        "--env.id",
        "letter_taskset",
        "--env.mix",
        '{"id": "toy_taskset"}',
    ]
    flags += ["--examples-per-step", "2", "--rollouts-per-example", "4", "--sampling.max-tokens", "16"]
    flags += ["--max-async-level", "0", "--checkpoint-every", "1", "--filter-flat-groups"]
    rl.main(parse(rl.Config, [*flags, "--steps", "2"]))
    rl.main(parse(rl.Config, [*flags, "--steps", "3", "--resume"]))

    saved, resumed = (
        json.loads((out / "checkpoints" / f"step_{n}" / "progress.json").read_text()) for n in (2, 3)
    )
    assert saved["env_tasks"]["toy_taskset"] > 0 and saved["task_index"] > 2 * 2  # the filter drew more
    # The draws the resumed run started are draws saved..resumed of the same seeded sequence.
    sequence = Mixture([Source("letter_taskset", None, []), Source("toy_taskset", None, [])])
    started = [sequence.choose(i).name for i in range(saved["task_index"], resumed["task_index"])]
    for name in ("letter_taskset", "toy_taskset"):
        assert resumed["env_tasks"][name] - saved["env_tasks"][name] == started.count(name), (saved, resumed)
