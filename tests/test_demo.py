"""scripts/demo.py end to end at toy sizes: every stage's command runs and hands its output to the next, and
a rerun runs only the stages an earlier run left undone."""

import contextlib
import hashlib
import io
import json
import re
import shutil
import tomllib
from pathlib import Path

import pytest
from conftest import load_script

from lib import rundir
from lib.config import UserError

demo = load_script("demo")


def preset_steps(name: str) -> int:
    """The steps a preset under configs/ sets (`name`: "smollm2/rl")."""
    return tomllib.loads((demo.ROOT / "configs" / f"{name}.toml").read_text())["steps"]


TOY = {"model": "tiny", "sft_steps": 4, "rl_steps": 2, "eval_examples": 4, "eval_rollouts": 1}


def files(directory) -> dict:
    """Every file under `directory`, with its modification time and content hash; not run.lock, which names the
    process that last held its directory (each demo, run and evaluation takes it: lib/runlock.py)."""
    return {
        str(path.relative_to(directory)): (
            path.stat().st_mtime_ns,
            hashlib.sha256(path.read_bytes()).hexdigest(),
        )
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != rundir.LOCK
    }


def commands(printed: str) -> list[str]:
    """The stage commands the demo printed, each as its script and the eval's name: "eval.py after-sft"."""
    ran = []
    for line in printed.splitlines():
        if line.startswith("$ python scripts/"):
            args = line.split()
            script = args[2].removeprefix("scripts/")
            ran.append(f"{script} {args[args.index('--name') + 1]}" if script == "eval.py" else script)
    return ran


def run_demo(cfg, stop_after: str | None = None) -> str:
    """demo.main(cfg), what it printed; with `stop_after`, it is killed once the command naming that ends."""
    real_run, printed = demo.run, io.StringIO()

    def killed_after(*args, **kwargs):
        real_run(*args, **kwargs)
        if stop_after in args:
            raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        if stop_after:
            patch.setattr(demo, "run", killed_after)
            with pytest.raises(KeyboardInterrupt):
                demo.main(cfg)
        else:
            demo.main(cfg)
    return printed.getvalue()


@pytest.fixture(scope="module")
def toy_demo(tmp_path_factory):
    """The toy demo killed right after its first evaluation, then run again to the end: what each run
    printed, and the files the first one left."""
    cfg = demo.Config(out=tmp_path_factory.mktemp("demo") / "demo", **TOY)
    first = run_demo(cfg, stop_after="after-sft")
    left = files(cfg.out)
    return {"cfg": cfg, "first": first, "left": left, "second": run_demo(cfg)}


@pytest.mark.slow
def test_demo_runs_every_stage_and_draws_the_curve(toy_demo):
    cfg = toy_demo["cfg"]
    result = demo.main(cfg)  # finished: it reads the results again
    assert 0.0 <= result["before"] <= 1.0 and 0.0 <= result["after"] <= 1.0
    assert (cfg.out / "sft" / "weights" / "step_4" / "config.json").is_file()
    assert (cfg.out / "rl" / "weights" / "step_2" / "config.json").is_file()
    assert sorted(p.name for p in (cfg.out / "eval").iterdir()) == ["after-rl", "after-sft"]
    png = cfg.out / "reward_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_figure_shows_each_stage_and_its_evaluations_as_points(tmp_path, monkeypatch):
    """SFT's loss, then RL's per-step reward, and the three held-out evaluations (sampled and greedy) as
    points at the steps they were taken: before SFT, after it, after RL."""
    import matplotlib.figure

    drawn = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda figure, path, **_: drawn.append(figure))
    monkeypatch.setattr("pathlib.Path.replace", lambda *_: None)  # savefig wrote no file to rename
    cfg = demo.resolved(demo.Config(out=tmp_path, sft_steps=20, rl_steps=2))
    (tmp_path / "sft").mkdir()
    lines = [json.dumps({"step": step, "train/loss": 2 / step}) for step in (10, 20)]
    (tmp_path / "sft" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    rollouts = tmp_path / "rl" / "rollouts"
    rollouts.mkdir(parents=True)
    for step in (1, 2):
        (rollouts / f"step_{step}.jsonl").write_text(json.dumps({"reward": step / 4}) + "\n")
    for name, value in (("base", 0.0), ("after-sft", 0.3), ("after-rl", 0.6)):
        for run_dir, scored in (
            (tmp_path / "eval" / name, value),
            (tmp_path / "eval" / f"{name}-greedy", value + 0.1),
        ):
            run_dir.mkdir(parents=True)
            (run_dir / "summary.json").write_text(json.dumps({"status": "ok", "avg_reward": scored}))
    demo.plot(cfg)
    reward_axes, loss_axes = drawn[0].axes
    assert reward_axes.get_ylabel() == "reward" and loss_axes.get_ylabel() == "SFT loss"
    legend = [text.get_text() for text in reward_axes.get_legend().get_texts()]
    assert legend == [
        "RL reward (mean of each step's sampled rollouts)",
        "held-out reward, sampled",
        "held-out reward, greedy",
        "SFT loss (right axis)",
    ]
    rl_line, sampled, greedy = reward_axes.get_lines()[:3]
    assert list(rl_line.get_xdata()) == [21, 22] and list(rl_line.get_ydata()) == [0.25, 0.5]
    assert list(sampled.get_xdata()) == [0, 20, 22] and list(sampled.get_ydata()) == [0.0, 0.3, 0.6]
    assert list(greedy.get_ydata()) == pytest.approx([0.1, 0.4, 0.7])


def test_a_failed_stage_is_one_sentence():
    import pytest

    from lib.config import UserError

    stage = r"the stage `python scripts/tiny\.py --no-such-flag` failed with exit code 2"
    with pytest.raises(UserError, match=f"^{stage} \\(its output is above\\)"):
        demo.run("scripts/tiny.py", "--no-such-flag")


@pytest.mark.slow
def test_an_interrupted_demo_runs_only_the_stages_it_had_left(toy_demo):
    assert commands(toy_demo["first"]) == ["tiny.py", "sft.py", "eval.py after-sft"]
    assert commands(toy_demo["second"]) == ["rl.py", "eval.py after-rl"]
    assert "model, sft, eval after SFT done already" in toy_demo["second"]
    now = files(toy_demo["cfg"].out)
    left = {
        name: stamp for name, stamp in toy_demo["left"].items() if name != demo.INPUTS
    }  # records RL's too
    assert {name: now[name] for name in left} == left


def test_the_summary_gives_each_stage_s_minutes_from_its_last_run(toy_demo):
    # The first run's stages were timed by it, the rest by the second run: the record keeps both. The
    # evaluation after SFT was killed as its command ended, before it was timed (then trusted as done).
    said = re.search(r"minutes by stage \(each one's last run\): (.*); ([\d.]+) in all", toy_demo["second"])
    assert said, toy_demo["second"][-2000:]
    parts = [part.rsplit(" ", 1) for part in said.group(1).split(", ")]
    assert [name for name, _ in parts] == ["model", "sft", "rl", "eval after RL", "reward curve"]
    recorded = demo.minutes(toy_demo["cfg"].out / demo.INPUTS)
    assert [f"{value:.1f}" for value in recorded.values()] == [value for _, value in parts]
    assert all(recorded[name] > 0 for name in ("sft", "rl", "eval after RL"))
    assert float(said.group(2)) == pytest.approx(sum(recorded.values()), abs=0.051)


@pytest.mark.slow
def test_a_finished_demo_rerun_touches_nothing_and_says_where_its_results_are(toy_demo):
    out = toy_demo["cfg"].out
    before = files(out)
    printed = run_demo(demo.Config(out=out, **TOY))
    assert files(out) == before
    assert commands(printed) == []
    assert f"the demo in {out} is finished: nothing to do" in printed
    assert f"reward curve: {out / 'reward_curve.png'}" in printed
    assert "make clean" in printed and "--out" in printed


@pytest.mark.slow
def test_an_interrupted_sft_stage_continues_from_its_last_checkpoint(toy_demo):
    """As if killed after checkpoint 3 of 4: the later stages' outputs stay, so only SFT runs."""
    out = toy_demo["cfg"].out
    sft = out / "sft"
    for name in ("weights", "checkpoints"):
        shutil.rmtree(sft / name / "step_4")
        assert (sft / name / "step_3").is_dir()

    # The record (inputs.json) changes too: it keeps the minutes of each stage's last run, SFT's now.
    def outside_sft() -> dict:
        return {n: stamp for n, stamp in files(out).items() if not n.startswith("sft/") and n != demo.INPUTS}

    later = outside_sft()
    minutes_before = demo.minutes(out / demo.INPUTS)
    printed = run_demo(demo.Config(out=out, **TOY))
    (sft_command,) = [line for line in printed.splitlines() if line.startswith("$ python scripts/sft.py")]
    assert "--resume" in sft_command.split() and commands(printed) == ["sft.py"]
    assert (sft / "weights" / "step_4" / "config.json").is_file()
    assert (sft / "checkpoints" / "step_4").is_dir()
    assert not (sft / "restarted").exists()  # where a start from step 0 would have moved steps 1-3
    assert outside_sft() == later
    minutes = demo.minutes(out / demo.INPUTS)
    assert minutes.keys() == minutes_before.keys() and minutes["sft"] > 0
    assert {k: v for k, v in minutes.items() if k != "sft"} == {
        k: v for k, v in minutes_before.items() if k != "sft"
    }


@pytest.mark.slow
def test_a_rerun_with_other_settings_or_into_a_foreign_directory_is_refused(toy_demo, tmp_path):
    out = toy_demo["cfg"].out
    before = files(out)
    with pytest.raises(
        UserError, match=r"^.* holds a demo run with other settings \(sft_steps 4 there, 5 now\)"
    ):
        demo.main(demo.Config(out=out, **{**TOY, "sft_steps": 5}))
    assert files(out) == before
    (tmp_path / "mine.txt").write_text("not a demo")
    with pytest.raises(UserError, match="holds files but no demo.toml") as refused:
        demo.main(demo.Config(out=tmp_path, **TOY))
    assert "--out" in str(refused.value) and "rm -r" not in str(refused.value)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["mine.txt"]


def test_a_second_demo_in_a_live_demos_out_is_refused_naming_its_pid(tmp_path):
    # Seen (#77 item 3): two demos on one --out set each other's runs aside (both pass --resume).
    import subprocess
    import sys

    from lib.config import write_config

    cfg = demo.Config(out=tmp_path / "demo", **TOY)
    write_config(demo.resolved(cfg), cfg.out / demo.SETTINGS)  # as the first demo left it
    holder = "import sys; from pathlib import Path; from lib import runlock; runlock.hold(Path(sys.argv[1]))"
    holder += "; print('holding', flush=True); sys.stdin.read()"
    first = subprocess.Popen(
        [sys.executable, "-c", holder, str(cfg.out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert first.stdout.readline().strip() == "holding"  # bounded: it ends with the process
        before = sorted(p.name for p in cfg.out.iterdir())
        with pytest.raises(UserError, match=rf"^{cfg.out} is in use by another run \(pid {first.pid} on "):
            demo.main(cfg)
        assert sorted(p.name for p in cfg.out.iterdir()) == before == ["demo.toml", "run.lock"]
    finally:
        first.stdin.close()
        first.wait(timeout=60)


def recording(monkeypatch, out) -> list:
    """Makes demo.run record each stage's command (in the list returned) instead of running it; an eval.py
    command leaves the summary.json of an evaluation whose every episode was scored."""
    ran = []

    def recorded(*args):
        ran.append(list(args))
        if args[0] == "scripts/eval.py":
            run_dir = out / "eval" / args[args.index("--name") + 1]
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "summary.json").write_text('{"status": "ok", "avg_reward": 0.0}')

    monkeypatch.setattr(demo, "run", recorded)
    return ran


@pytest.mark.parametrize(
    ("recipe", "presets", "target"),
    [("arithmetic", "smollm2_two_digit", "demo"), ("reverse-text", "smollm2", "demo-reverse-text")],
)
def test_the_real_model_demos_are_sft_then_rl_with_their_presets(
    tmp_path, monkeypatch, recipe, presets, target
):
    """`make demo` (two-digit arithmetic) and `make demo-reverse-text` (the seed recipe), run with `run`
    recording instead of running: base eval, SFT, eval, RL, eval on the same held-out tasks (sampled, then
    greedy), each command one its script accepts, with the recipe's presets and the SmolLM2 directory; the
    make target runs that recipe, and --seed reaches both training stages."""
    from test_makefile import dry_run

    from lib.config import parse
    from lib.models.smollm2 import SMOLLM2_DIR

    assert dry_run(target) == [".venv/bin/python", "scripts/demo.py"] + (
        ["--recipe", recipe] if recipe != "arithmetic" else []
    )
    ran = recording(monkeypatch, tmp_path / "demo")
    given = ["--out", str(tmp_path / "demo"), "--seed", "3"] + (
        ["--recipe", recipe] if recipe != "arithmetic" else []
    )
    cfg = demo.resolved(demo.parse(demo.Config, given))
    assert cfg.recipe == recipe and cfg.presets == presets
    stages = demo.stages(cfg, contextlib.ExitStack())  # the builtin engine: no server of its own to stop
    assert [stage.name for stage in stages] == [
        "model",
        "eval of the base model",
        "sft",
        "eval after SFT",
        "rl",
        "eval after RL",
        "reward curve",
    ]
    for stage in stages[:-1]:
        stage.run()
    scripts = [args[0].removeprefix("scripts/") for args in ran]
    assert scripts == ["smollm2.py", *["eval.py"] * 2, "sft.py", *["eval.py"] * 2, "rl.py", *["eval.py"] * 2]
    configs = {}
    for args in ran[1:]:
        script = load_script(args[0].removeprefix("scripts/").removesuffix(".py"))
        configs.setdefault(args[0], []).append(parse(script.Config, args[1:]))
    evals, (sft,), (rl,) = (configs[f"scripts/{name}.py"] for name in ("eval", "sft", "rl"))
    assert sft.model.name == str(SMOLLM2_DIR) and sft.steps == cfg.sft_steps and sft.resume
    assert sft.seed == rl.seed == 3
    # The steps are the presets' own, read from them rather than written again in the demo.
    assert (sft.steps, rl.steps) == (preset_steps(f"{presets}/sft"), preset_steps(f"{presets}/rl"))
    assert (
        rl.model.name == str(sft.output_dir / "weights" / f"step_{cfg.sft_steps}")
        and rl.steps == cfg.rl_steps
    )
    weights = [
        SMOLLM2_DIR,
        sft.output_dir / "weights" / f"step_{sft.steps}",
        rl.output_dir / "weights" / f"step_{rl.steps}",
    ]
    assert [e.model.name for e in evals] == [str(w) for w in weights for _ in range(2)]
    # One held-out set (seed 1: training draws seed 0), sampled at RL's temperature, then greedy.
    assert {(e.seed, e.num_examples) for e in evals} == {(1, cfg.eval_examples)} and sft.data.seed == 0
    assert [e.sampling.temperature for e in evals] == [rl.sampling.temperature, 0.0] * 3
    assert {e.env for e in evals} == {sft.data.id} == {rl.env.id} == {cfg.env}
    if (
        recipe == "arithmetic"
    ):  # held out by the split: SFT and RL train on train, every evaluation is on test
        assert sft.data.kwargs["split"] == rl.env.kwargs["split"] == "train"
        assert {json.loads(e.env_args)["split"] for e in evals} == {"test"}
        assert sft.data.kwargs["max_operand"] == rl.env.kwargs["max_operand"] == 30
        assert {json.loads(e.env_args)["max_operand"] for e in evals} == {30}
    # An evaluation killed between its sampled and its greedy run is not done: a rerun does both.
    shutil.rmtree(cfg.out / "eval")
    (cfg.out / "eval" / "base").mkdir(parents=True)
    (cfg.out / "eval" / "base" / "summary.json").write_text('{"status": "ok", "avg_reward": 0.0}')
    assert not stages[1].done()
    (cfg.out / "eval" / "base-greedy").mkdir()
    (cfg.out / "eval" / "base-greedy" / "summary.json").write_text('{"status": "ok", "avg_reward": 0.0}')
    assert stages[1].done()


@pytest.mark.slow
@pytest.mark.vllm
def test_the_demo_through_vllm_runs_every_stage_on_one_server(
    vllm_server, trained_tiny, tmp_path, monkeypatch
):
    """--engine vllm: every evaluation and the RL stage go to one vLLM server, started once, which loads each
    stage's weights (the session's server stands in for the one the demo would start)."""
    import json
    import os

    import lib.inference.launch
    from lib.inference.weights import reload

    started = []

    @contextlib.contextmanager
    def session_server(model, **kwargs):
        started.append(kwargs["engine"])
        yield vllm_server

    loaded, real_reload = [], reload.reload_weights

    def reload_weights(urls, weights, *args, **kwargs):
        loaded.append(weights)
        real_reload(urls, weights, *args, **kwargs)

    monkeypatch.setattr(lib.inference.launch, "running_server", session_server)
    monkeypatch.setattr(reload, "reload_weights", reload_weights)
    cfg = demo.resolved(
        demo.Config(out=tmp_path / "demo", engine="vllm", **TOY | {"sft_steps": 2, "rl_steps": 1})
    )
    try:
        printed = run_demo(cfg)
    finally:
        real_reload([vllm_server.url], trained_tiny, None, "default")
    assert started == ["vllm"]
    # The evaluations after SFT and after RL ran on the server, each after it loaded that stage's weights
    # (a reload checks the served weights' fingerprint against the files).
    assert loaded == [cfg.out / "sft" / "weights" / "step_2", cfg.out / "rl" / "weights" / "step_1"]
    evals = [line for line in printed.splitlines() if line.startswith("$ python scripts/eval.py")]
    assert len(evals) == 2 and all(f"-m policy -b {vllm_server.url} " in line for line in evals)
    # RL trained against it, its trainer on the core vLLM's worker leaves.
    (rl,) = [line for line in printed.splitlines() if "scripts/rl.py" in line]
    assert (
        rl.startswith(f"$ OMP_NUM_THREADS={max(1, os.cpu_count() - 1)} python ")
        and f"--inference.urls {vllm_server.url}" in rl
    )
    provenance = json.loads((cfg.out / "rl" / "provenance.json").read_text())
    assert [server["url"] for server in provenance["servers"]] == [vllm_server.url]
    assert (cfg.out / "reward_curve.png").is_file()


def test_the_rl_first_demo_is_base_eval_rl_eval_on_held_out_arithmetic(tmp_path, monkeypatch):
    """`make demo-arithmetic`'s stages, recorded instead of run: the base model evaluated on the arithmetic
    taskset's test split, RL from the base model on its train split (no SFT), the same evaluation after; each
    command one its script accepts. And the make target runs exactly this demo."""
    from test_makefile import dry_run

    from lib.config import parse
    from lib.models.smollm2 import SMOLLM2_DIR

    assert dry_run("demo-arithmetic") == [".venv/bin/python", "scripts/demo.py", "--recipe", "rl-first"]
    ran = recording(monkeypatch, tmp_path / "demo")
    cfg = demo.resolved(demo.parse(demo.Config, ["--recipe", "rl-first", "--out", str(tmp_path / "demo")]))
    stages = demo.stages(cfg, contextlib.ExitStack())
    names = ["model", "eval of the base model", "rl", "eval after RL", "reward curve"]
    assert [stage.name for stage in stages] == names
    for stage in stages[:-1]:
        stage.run()
    assert [args[0] for args in ran] == ["scripts/smollm2.py", *["scripts/eval.py"] * 2, "scripts/rl.py"] + [
        "scripts/eval.py"
    ] * 2
    evals = [parse(load_script("eval").Config, args[1:]) for args in ran if args[0] == "scripts/eval.py"]
    (rl,) = [parse(load_script("rl").Config, args[1:]) for args in ran if args[0] == "scripts/rl.py"]
    assert (
        rl.model.name == str(SMOLLM2_DIR) and rl.steps == cfg.rl_steps and rl.env.id == "plainrl_arithmetic"
    )
    assert rl.env.kwargs["split"] == "train" and rl.steps == preset_steps("smollm2_arithmetic/rl")
    weights = [str(SMOLLM2_DIR), str(rl.output_dir / "weights" / f"step_{rl.steps}")]
    assert [e.model.name for e in evals] == [w for w in weights for _ in range(2)]
    assert {(e.env, json.loads(e.env_args)["split"], e.num_examples) for e in evals} == {
        ("plainrl_arithmetic", "test", 256)
    }
    assert [e.sampling.temperature for e in evals] == [rl.sampling.temperature, 0.0] * 2
    with pytest.raises(UserError, match="SmolLM2 only"):
        demo.Config(recipe="rl-first", model="tiny")
    with pytest.raises(UserError, match="must be at least 1"):
        demo.main(demo.Config(recipe="rl-first", rl_steps=0, out=tmp_path / "none"))
    assert not (tmp_path / "none").exists()  # refused before it made anything


def half_failed(run_dir) -> None:
    """What eval.py leaves when its server dies halfway: status partial, the failed episodes scored 0."""
    import json

    summary = json.loads((run_dir / "summary.json").read_text())
    summary |= {"status": "partial", "num_errors": 2, "error_rate": 0.5, "errors": {"ConnectError": 2}}
    summary["avg_reward"] /= 2
    (run_dir / "summary.json").write_text(json.dumps(summary))


@pytest.mark.slow
def test_a_half_failed_evaluation_stops_the_demo_naming_it_and_a_rerun_redoes_it(toy_demo):
    out = toy_demo["cfg"].out
    after_rl = out / "eval" / "after-rl"
    half_failed(after_rl)  # left by an earlier demo
    real_run = demo.run

    def server_dies_during_the_evaluation(*args, **kwargs):
        real_run(*args, **kwargs)
        if "after-rl" in args:
            half_failed(after_rl)

    with pytest.MonkeyPatch.context() as patch, pytest.raises(UserError) as stopped:
        patch.setattr(demo, "run", server_dies_during_the_evaluation)
        run_demo(demo.Config(out=out, **TOY))
    sentence = str(stopped.value)
    assert str(after_rl) in sentence and "2 of" in sentence and "\n" not in sentence, sentence
    assert (
        not (out / "reward_curve.png").is_file()
        or (out / "reward_curve.png").stat().st_mtime_ns < (after_rl / "summary.json").stat().st_mtime_ns
    )  # no curve drawn from it
    printed = run_demo(demo.Config(out=out, **TOY))
    assert commands(printed) == ["eval.py after-rl"]
    import json

    assert json.loads((after_rl / "summary.json").read_text())["status"] == "ok"


@pytest.mark.slow
def test_stages_made_from_weights_that_changed_since_are_redone(toy_demo):
    """SFT redone into other weights: the evaluation after SFT, RL from them and what follows are stale."""
    from safetensors.torch import load_file, save_file

    out = toy_demo["cfg"].out
    run_demo(demo.Config(out=out, **TOY))  # finished, whatever the tests before left
    weights = out / "sft" / "weights" / "step_4" / "model.safetensors"
    tensors = load_file(weights)
    save_file({name: tensor * 1.01 for name, tensor in tensors.items()}, weights, metadata={"format": "pt"})
    old_rl = files(out / "rl")
    printed = run_demo(demo.Config(out=out, **TOY))
    assert commands(printed) == ["eval.py after-sft", "rl.py", "eval.py after-rl"]
    (moved,) = (out / "rl" / "restarted").iterdir()  # the RL run from the old weights, set aside
    assert files(moved)["checkpoints/step_2/manifest.json"] == old_rl["checkpoints/step_2/manifest.json"]
    assert (out / "rl" / "checkpoints" / "step_2").is_dir()
    assert commands(run_demo(demo.Config(out=out, **TOY))) == []


@pytest.mark.slow
def test_a_redone_evaluation_killed_before_it_finished_is_redone_again(toy_demo):
    """New RL weights make the evaluation after RL stale; killed as it starts again (its old summary still
    there), the next run must redo it, not report the old weights' score."""
    from safetensors.torch import load_file, save_file

    out = toy_demo["cfg"].out
    run_demo(demo.Config(out=out, **TOY))  # finished, whatever the tests before left
    weights = out / "rl" / "weights" / "step_2" / "model.safetensors"
    save_file({k: v * 0.99 for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})

    def killed_as_it_starts(*args, **kwargs):
        if "after-rl" in args:
            raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(demo, "run", killed_as_it_starts)
        run_demo(demo.Config(out=out, **TOY))
    assert commands(run_demo(demo.Config(out=out, **TOY))) == ["eval.py after-rl"]


@pytest.mark.slow
def test_the_arithmetic_demo_runs_every_stage_held_out_on_a_small_model(tmp_path, monkeypatch, tiny_dir):
    """`make demo`'s stages for real, with its presets, on the tiny model in SmolLM2's place and the fewest
    steps: each stage hands its output to the next, the report gives each stage's reward and its gain, and
    no problem an evaluation scores is one SFT or RL trained on."""
    import plainrl_arithmetic as arith

    monkeypatch.setattr(demo, "SMOLLM2_DIR", tiny_dir)
    cfg = demo.Config(out=tmp_path / "demo", sft_steps=2, rl_steps=2, eval_examples=8, eval_rollouts=1)
    printed = run_demo(cfg)
    assert commands(printed) == [
        "eval.py base",
        "eval.py base-greedy",
        "sft.py",
        "eval.py after-sft",
        "eval.py after-sft-greedy",
        "rl.py",
        "eval.py after-rl",
        "eval.py after-rl-greedy",
    ]
    report = printed[printed.index("reward of the base model") :].splitlines()
    assert report[0].startswith("reward of the base model 0.") and ", reward after SFT 0." in report[0]
    assert " -> after RL 0." in report[0] and report[0].endswith(" min)")
    assert report[1].startswith("gains, sampled") and "after SFT " in report[1] and "after RL " in report[1]
    assert report[2].startswith("greedy: ")
    assert (cfg.out / "reward_curve.png").read_bytes()[:4] == b"\x89PNG"

    def problems(lines) -> set[str]:
        """The problems in result or rollout records (their prompt: messages, or rl.py's text of them)."""
        prompts = [json.dumps(json.loads(line)["prompt"]) for line in lines]
        return {arith.canonical(re.search(r"What is ([-+* 0-9]+)\?", p).group(1)) for p in prompts}

    scored = problems((cfg.out / "eval" / "after-rl" / "results.jsonl").read_text().splitlines())
    trained = problems(
        line
        for path in (cfg.out / "rl" / "rollouts").glob("*.jsonl")
        for line in path.read_text().splitlines()
    )
    from lib.orchestrator.tasks import EnvConfig, sft_conversations

    sft_args = tomllib.loads((demo.ROOT / "configs" / "smollm2_two_digit" / "sft.toml").read_text())["data"]
    sft_data = sft_conversations(EnvConfig(id=sft_args["id"], args=sft_args["args"], num_examples=4000))
    taught = {arith.canonical(c[1]["content"].removeprefix("What is ").removesuffix("?")) for c in sft_data}
    assert len(scored) == 8 and trained and not scored & (trained | taught)


def pretending(monkeypatch) -> list:
    """Makes demo.run pretend each stage's command ran, in no time, and record it ("rl.py", "eval.py after-rl"):
    it leaves the files the demo looks for, other weights and scores each time; the figure is a stand-in."""
    ran = []

    def pretended(*args, env=None):
        script, made = args[0].removeprefix("scripts/"), str(len(ran))
        if script == "tiny.py":
            model = Path(args[args.index("--out") + 1])
            model.mkdir(parents=True)
            (model / "config.json").write_text(made)
        elif script == "eval.py":
            run_dir = Path(args[args.index("--output-dir") + 1]) / args[args.index("--name") + 1]
            run_dir.mkdir(parents=True, exist_ok=True)
            scores = [{"task_id": str(i), "rollout": 0, "reward": len(ran) % 2} for i in range(2)]
            (run_dir / "results.jsonl").write_text("".join(json.dumps(s) + "\n" for s in scores))
            (run_dir / "summary.json").write_text(json.dumps({"status": "ok", "avg_reward": len(ran) % 2}))
            script += f" {run_dir.name}"
        else:  # sft.py, rl.py
            run_dir, steps = Path(args[args.index("--output-dir") + 1]), args[args.index("--steps") + 1]
            (run_dir / "checkpoints" / f"step_{steps}").mkdir(parents=True)
            (run_dir / "weights" / f"step_{steps}").mkdir(parents=True)
            (run_dir / "weights" / f"step_{steps}" / "model.safetensors").write_text(made)
        ran.append(script)

    monkeypatch.setattr(demo, "run", pretended)
    monkeypatch.setattr(demo, "plot", lambda cfg: (cfg.out / "reward_curve.png").write_bytes(b"\x89PNG"))
    return ran


def test_a_stage_whose_presets_or_taskset_changed_is_redone_with_the_stages_after_it(tmp_path, monkeypatch):
    """Not only weights and results: a stage is made from its command's resolved config (the presets it reads
    included) and its taskset's code, and a change in either redoes it and what it handed on."""
    configs, tasksets = tmp_path / "configs", tmp_path / "tasksets"
    shutil.copytree(demo.ROOT / "configs" / "tiny", configs / "tiny")
    shutil.copytree(demo.TASKSETS / "plainrl_reverse_text", tasksets / "plainrl_reverse_text")
    monkeypatch.setattr(demo, "CONFIGS", configs)
    monkeypatch.setattr(demo, "TASKSETS", tasksets)
    ran, cfg = pretending(monkeypatch), demo.Config(out=tmp_path / "demo", **TOY)

    def rerun() -> list[str]:
        ran.clear()
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            demo.main(cfg)
        return ran if ran else [printed.getvalue()]

    assert rerun() == ["tiny.py", "sft.py", "eval.py after-sft", "rl.py", "eval.py after-rl"]
    assert "nothing to do" in rerun()[0]

    def edit(path, old: str, new: str) -> None:
        assert old in path.read_text()
        path.write_text(path.read_text().replace(old, new))

    edit(configs / "tiny" / "rl.toml", "lr = 3e-4", "lr = 0.5")
    assert rerun() == ["rl.py", "eval.py after-rl"]
    assert "nothing to do" in rerun()[0]
    edit(configs / "tiny" / "eval.toml", "max_tokens = 128", "max_tokens = 100")
    assert rerun() == ["eval.py after-sft", "eval.py after-rl"]
    cache = tasksets / "plainrl_reverse_text" / "__pycache__"
    cache.mkdir(exist_ok=True)
    (cache / "__init__.cpython-311.pyc").write_bytes(b"compiled")  # written by an import, not the code
    assert "nothing to do" in rerun()[0]
    with open(tasksets / "plainrl_reverse_text" / "__init__.py", "a") as code:
        code.write("# changed\n")
    assert rerun() == ["sft.py", "eval.py after-sft", "rl.py", "eval.py after-rl"]
    assert "nothing to do" in rerun()[0]


def test_an_out_that_is_a_file_is_refused_in_one_sentence(tmp_path):
    # Seen: `--out FILE` ended in FileExistsError's traceback.
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    for out in (mine, mine / "demo"):
        with pytest.raises(UserError, match=rf"^--out {out}: {mine} is a file, not a directory"):
            demo.main(demo.Config(out=out, **TOY))
    assert mine.read_text() == "mine" and list(tmp_path.iterdir()) == [mine]
