"""The run directory a run claims: what it refuses, what a restart sets aside, what --resume continues (its
checkpoints, its own config), on one rank and on two."""

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import ROOT, load_script

from lib.config import UserError, parse, write_config
from lib.inference import launch
from lib.trainer.checkpoint import open_run, write_manifest


def open_dir(cfg):
    """open_run in a single process, saying what it says on stdout."""
    return open_run(cfg, print)


def config(script: str, run_dir, *flags):
    module = load_script(script)
    return parse(module.Config, ["--output-dir", str(run_dir), *flags])


def write_files(root, *names) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)


def checkpoint(run_dir, step: int) -> None:
    """checkpoints/step_N as open_run sees it: files and their manifest (no training state is loaded)."""
    path = run_dir / "checkpoints" / f"step_{step}"
    path.mkdir(parents=True)
    (path / "model.pt").write_bytes(b"weights")
    write_manifest(path)


def test_a_directory_that_holds_no_run_is_refused_in_one_sentence_and_left_untouched(tmp_path):
    """`--output-dir outputs` (where the model to train lives) or `--output-dir .` in a clone: nothing there
    is a run's, so nothing may move."""
    outputs, clone = tmp_path / "outputs", tmp_path / "clone"
    write_files(outputs, "models/tiny/config.json", "eval/x/summary.json", "notes.txt")
    write_files(clone, ".git/HEAD", "lib/config.py", "scripts/rl.py", "Makefile")
    for directory in (outputs, clone):
        before = sorted(p.relative_to(directory) for p in directory.rglob("*"))
        with pytest.raises(UserError) as error:
            open_dir(config("sft", directory))
        sentence = str(error.value)
        assert sentence.startswith(f"{directory} holds other files (") and "\n" not in sentence, sentence
        assert sentence.endswith(
            "and no run of this script (no config.toml or provenance.json that plainrl wrote for it): give "
            "--output-dir a new or empty directory."
        )
        assert sorted(p.relative_to(directory) for p in directory.rglob("*")) == before
    # A SLURM job writes its script into the run directory before the run: that one is taken.
    write_files(tmp_path / "job", "slurm/job.sh")
    assert open_dir(config("rl", tmp_path / "job")) is None
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == [
        "base.json",
        "config.toml",
        "run.lock",  # the run that holds it (lib/rundir.py hold)
        "slurm",
    ]


@pytest.mark.parametrize("script", ["sft", "rl"])
def test_a_refused_directory_prints_no_run_dir_line(script, tmp_path, capsys):
    """A run's first line names its run directory; a directory refused before any run starts is no run's."""
    write_files(tmp_path / "outputs", "notes.txt")
    with pytest.raises(UserError):
        open_dir(config(script, tmp_path / "outputs"))
    assert "run dir:" not in capsys.readouterr().out
    assert open_dir(config(script, tmp_path / "new")) is None
    assert capsys.readouterr().out.splitlines()[0] == f"run dir: {tmp_path / 'new'}"


def test_rl_given_an_sft_runs_directory_says_it_is_one_and_not_to_resume_it(tmp_path, capsys):
    """`make rl ... OUT=outputs/sft`: the SFT run's checkpoints are no RL run to --resume."""
    run_dir = tmp_path / "sft"
    open_dir(config("sft", run_dir))
    (run_dir / "provenance.json").write_text(json.dumps({"plainrl_revision": "0123abc"}))
    checkpoint(run_dir, 2)
    write_files(run_dir, "weights/step_1/config.json", "weights/step_2/config.json")
    capsys.readouterr()
    expected = (
        f"{run_dir} holds an sft.py run, not one of rl.py's: give rl.py another --output-dir (it starts from "
        f"the SFT run's weights with --model.name {run_dir / 'weights' / 'step_2'})"
    )
    with pytest.raises(UserError) as error:
        open_dir(config("rl", run_dir))
    assert str(error.value) == expected and "run dir:" not in capsys.readouterr().out
    # With --resume the run's own config is read first: the same sentence, not an unknown key of sft.py's.
    rl = load_script("rl")
    with pytest.raises(SystemExit):
        parse(rl.Config, ["--output-dir", str(run_dir), "--resume"])
    assert capsys.readouterr().err.strip() == f"error: {expected}"
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "base.json",
        "checkpoints",
        "config.toml",
        "provenance.json",
        "run.lock",
        "weights",
    ]


def test_each_scripts_config_alone_has_its_field_in_script_fields():
    """How a config.toml says which script wrote it (lib/rundir.py SCRIPT_FIELDS)."""
    import dataclasses

    from lib import rundir

    for script in ("sft", "rl", "eval"):
        fields = {field.name for field in dataclasses.fields(load_script(script).Config)}
        assert [name for field, name in rundir.SCRIPT_FIELDS.items() if field in fields] == [f"{script}.py"]


def test_a_restart_sets_aside_what_a_run_writes_and_nothing_else(tmp_path, capsys):
    run_dir = tmp_path / "run"
    write_config(config("rl", run_dir), run_dir / "config.toml")
    written = [
        "provenance.json",
        "tb/events",
        "metrics.jsonl",
        "weights/step_3/config.json",
        "rollouts/step_3.jsonl",
    ]
    write_files(
        run_dir, *written, "base.json", "wandb_id", "eval/step_0/reverse_text.jsonl", "reward_curve.png"
    )
    write_files(run_dir, "notes.txt", "data/train.jsonl", "slurm/job.sh")  # the user's, the job's
    (run_dir / "checkpoints" / ".tmp-step_10").mkdir(parents=True)  # killed while writing its first
    assert open_dir(config("rl", run_dir, "--resume")) is None
    (moved,) = (run_dir / "restarted").iterdir()
    assert f"no checkpoint in {run_dir}: starting at step 0; the earlier run's outputs are in {moved}" in (
        capsys.readouterr().out
    )
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "base.json",
        "config.toml",
        "data",
        "notes.txt",
        "restarted",
        "run.lock",  # not set aside: the new run holds it
        "slurm",
    ]
    for name in [*written, "wandb_id", "eval/step_0/reverse_text.jsonl", "reward_curve.png"]:
        assert (moved / name).read_text() == name
    assert (moved / "checkpoints").is_dir()
    assert (moved / "config.toml").is_file()  # the dead run's config, copied before it is rewritten
    assert (moved / "base.json").read_text() == "base.json"  # and its base model's record
    assert (run_dir / "notes.txt").read_text() == "notes.txt"
    assert open_dir(config("rl", run_dir, "--resume")) is None  # nothing more to set aside
    assert len(list((run_dir / "restarted").iterdir())) == 1


def test_resume_with_every_checkpoint_damaged_stops_and_names_them(tmp_path, capsys):
    run_dir = tmp_path / "run"
    write_config(config("sft", run_dir), run_dir / "config.toml")
    for step in (2, 4):
        checkpoint(run_dir, step)
        (run_dir / "checkpoints" / f"step_{step}" / "model.pt").write_bytes(b"")
    with pytest.raises(UserError, match=r"every one is damaged \(step_2, step_4\)"):
        open_dir(config("sft", run_dir, "--resume"))
    assert "step_4 is damaged" in capsys.readouterr().out
    with pytest.raises(UserError, match="already holds checkpoints: pass --resume"):
        open_dir(config("sft", run_dir))
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "config.toml"]  # nothing moved


def test_resume_in_an_empty_directory_starts_at_step_0_and_says_so(tmp_path, capsys):
    """A SLURM job's first run passes --resume too."""
    for script in ("rl", "sft"):
        run_dir = tmp_path / script
        assert open_dir(config(script, run_dir, "--resume")) is None
        assert f"no checkpoint in {run_dir}: starting at step 0" in capsys.readouterr().out
        assert (run_dir / "config.toml").is_file()


def test_resume_takes_the_runs_config_over_the_presets_and_flags_over_both(tmp_path, capsys):
    """`make rl ENV=tiny ARGS=--resume` after `make rl ENV=tiny MODEL=...`: the preset's model is not the
    run's."""
    rl, run_dir = load_script("rl"), tmp_path / "run"
    started = config("rl", run_dir, "--model.name", "outputs/sft/weights/step_40", "--optim.lr", "1e-3")
    write_config(started, run_dir / "config.toml")
    preset = tmp_path / "preset.toml"
    preset.write_text('steps = 9\n[model]\nname = "outputs/tiny/sft/weights/step_2000"\n[optim]\nlr = 3e-4\n')
    resumed = parse(rl.Config, ["@", str(preset), "--output-dir", str(run_dir), "--resume"])
    assert (resumed.model.name, resumed.optim.lr, resumed.steps) == ("outputs/sft/weights/step_40", 1e-3, 20)
    (note,) = capsys.readouterr().err.splitlines()
    assert (
        "model.name 'outputs/tiny/sft/weights/step_2000' (the run's: 'outputs/sft/weights/step_40')" in note
    )
    assert "optim.lr 0.0003 (the run's: 0.001)" in note and "steps 9 (the run's: 20)" in note
    flags = ["@", str(preset), "--output-dir", str(run_dir), "--resume", "--optim.lr", "5e-4"]
    assert parse(rl.Config, flags).optim.lr == 5e-4
    assert "optim.lr" not in capsys.readouterr().err  # a flag is not ignored
    fresh = parse(rl.Config, ["--output-dir", str(tmp_path / "new"), "--resume"])
    assert fresh.model.name == "outputs/models/tiny"  # no run there yet: defaults < presets < flags


def test_a_resume_says_and_records_what_it_changes_and_refuses_another_model(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert open_dir(config("sft", run_dir, "--steps", "4")) is None
    original = (run_dir / "config.toml").read_text()
    checkpoint(run_dir, 2)
    capsys.readouterr()
    resume_from = open_dir(config("sft", run_dir, "--resume", "--steps", "6", "--optim.lr", "1e-3"))
    assert resume_from == run_dir / "checkpoints" / "step_2"
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("resuming from step 2 with changes to the run's config:"), line
    assert "optim.lr 1e-05 -> 0.001" in line and "steps 4 -> 6" in line and "resumes.jsonl" in line
    (record,) = [json.loads(text) for text in (run_dir / "resumes.jsonl").read_text().splitlines()]
    assert record["step"] == 2 and record["changed"] == {"optim.lr": [1e-5, 1e-3], "steps": [4, 6]}
    assert (run_dir / "config.toml").read_text() == original  # what the run started with stays on record
    # The next resume continues from what the last one recorded, and only a new change is said again.
    again = parse(load_script("sft").Config, ["--output-dir", str(run_dir), "--resume"])
    assert (again.steps, again.optim.lr) == (6, 1e-3)
    assert open_dir(again) == resume_from and "changes" not in capsys.readouterr().out
    for flag, value in (("--model.name", "other/model"), ("--lora.rank", "8")):
        with pytest.raises(
            UserError, match=f"--resume continues {run_dir} as it was trained, with {flag[2:]}"
        ):
            open_dir(config("sft", run_dir, "--resume", flag, value))
    assert len((run_dir / "resumes.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("script", ["sft", "rl"])
def test_resuming_a_finished_run_says_nothing_to_do_before_any_model_or_server(
    script, tiny_dir, tmp_path, capsys, monkeypatch
):
    import lib.inference.launch
    import lib.models.load

    def never(*args, **kwargs):
        raise AssertionError("a finished run loaded a model or started a server")

    monkeypatch.setattr(lib.trainer.trainable, "load_trainable", never)
    monkeypatch.setattr(lib.inference.launch, "start_or_attach", never)
    run_dir = tmp_path / "run"
    flags = ["--model.name", str(tiny_dir), "--steps", "3"]
    open_dir(config(script, run_dir, *flags))
    checkpoint(run_dir, 3)
    capsys.readouterr()
    result = load_script(script).main(config(script, run_dir, *flags, "--resume"))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == lines[-1] == f"run dir: {run_dir}"
    assert lines[1] == (
        f"nothing to do: {run_dir} is done: its last checkpoint is step 3 of --steps 3 (a higher --steps trains on)"
    )
    assert result["history"] == [] and not (run_dir / "resumes.jsonl").exists()


def test_on_two_ranks_only_rank_0_looks_at_the_run_directory(tiny_dir, tmp_path):
    """Rank 1 checks the checkpoint's files while rank 0 sets the directory aside, as a rank on a slower node
    may (tests/fixtures/hooks): ranks that decide alone disagree. Both must stop with rank 0's sentence, and
    nothing moves."""
    run_dir = tmp_path / "run"
    write_config(config("sft", run_dir), run_dir / "config.toml")
    checkpoint(run_dir, 2)
    (run_dir / "checkpoints" / "step_2" / "model.pt").write_bytes(b"")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{ROOT / 'tests/fixtures/hooks'}"}
    env |= {"PLAINRL_TEST_INTERLEAVE": str(tmp_path / "marks"), "WORLD_SIZE": "2"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(launch.free_port())}
    (tmp_path / "marks").mkdir()
    flags = ["--model.name", str(tiny_dir), "--output-dir", str(run_dir), "--resume", "--steps", "1"]
    flags += ["--batch-size", "2", "--micro-batch-size", "1"]
    # The two ranks torchrun would start, without torchrun's own start-up.
    ranks = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "scripts/sft.py"), *flags],
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    try:
        errors = [process.communicate(timeout=120)[1] for process in ranks]
    finally:  # ranks that disagree wait in a collective forever: none may outlive the test
        for process in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    sentence = f"error: no checkpoint in {run_dir}/checkpoints can be resumed, every one is damaged (step_2)"
    for process, stderr in zip(ranks, errors):
        assert process.returncode == 2 and sentence in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "config.toml"]


def test_a_folder_with_someone_elses_config_toml_or_provenance_json_is_no_run_and_stays_untouched(tmp_path):
    """`config.toml` and `provenance.json` are common names (a Rust crate, a website): only the ones plainrl
    writes make a run directory, a config.toml only for the script whose config it is."""
    site, other = tmp_path / "site", tmp_path / "other"
    write_files(site, "eval/results.csv", "weights/notes.txt", "README.md")
    (site / "config.toml").write_text('[package]\nname = "mysite"\n')
    write_files(other, "provenance.json", "notes.txt")
    (other / "provenance.json").write_text('{"name": "mysite"}')
    rl_run = tmp_path / "rl_run"  # an rl.py run that died before its provenance.json: not sft.py's to restart
    write_config(config("rl", rl_run), rl_run / "config.toml")
    write_files(rl_run, "tb/events")

    def files(directory):
        return {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*") if p.is_file()}

    for directory in (site, other, rl_run):
        before = files(directory)
        with pytest.raises(UserError) as error:
            open_dir(config("sft", directory))
        sentence = str(error.value)
        if directory == rl_run:  # plainrl's config.toml, another script's: it says whose
            assert (
                sentence
                == f"{directory} holds an rl.py run, not one of sft.py's: give sft.py another --output-dir"
            )
        else:
            assert (
                sentence.startswith(f"{directory} holds other files (")
                and "no run of this script" in sentence
            )
        assert files(directory) == before
    # plainrl's own are still recognised: its provenance.json alone, or the script's own config.toml.
    write_files(tmp_path / "sft_run", "tb/events")
    write_config(config("sft", tmp_path / "sft_run"), tmp_path / "sft_run" / "config.toml")
    assert open_dir(config("sft", tmp_path / "sft_run")) is None
    assert (tmp_path / "sft_run" / "restarted").is_dir()


HOLDER = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from conftest import load_script
from lib.config import parse
from lib.trainer.checkpoint import open_run
sft = load_script("sft")
run_dir = Path(sys.argv[2])
open_run(parse(sft.Config, ["--output-dir", str(run_dir), "--resume"]), print)
(run_dir / "tb").mkdir()
(run_dir / "tb" / "events").write_text("the live run's")
print("holding", flush=True)
sys.stdin.read()  # until the test closes it
"""


def test_a_second_run_into_a_live_runs_directory_is_refused_with_the_holders_pid(tiny_dir, tmp_path):
    # Seen (#77 item 3): a second `sft.py --resume` into a live run's directory moved the first run's outputs
    # to restarted/ (no checkpoint yet), and the first died on its tensorboard file.
    run_dir, data = tmp_path / "run", tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "abc", "completion": "cba"}) + "\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(ROOT / "tests"), str(run_dir)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        lines = []
        while "holding" not in lines:  # bounded: the holder's output ends when it exits
            line = holder.stdout.readline()
            assert line, f"the holder ended: {lines}"
            lines.append(line.strip())
        before = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
        second = subprocess.run(
            [sys.executable, str(ROOT / "scripts/sft.py"), "--model.name", str(tiny_dir), "--data.id", str(data),
             "--output-dir", str(run_dir), "--resume", "--steps", "1"],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-3000:]
        (error,) = second.stderr.strip().splitlines()
        assert error.startswith(f"error: {run_dir} is in use by another run (pid {holder.pid}"), error
        assert "run dir:" not in second.stdout
        after = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
        assert after == before and not (run_dir / "restarted").exists()
        assert holder.poll() is None  # the live run goes on
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    # Its holder gone (however it ended: the kernel drops the lock), the directory is a run's to resume.
    assert open_dir(config("sft", run_dir, "--resume")) is None
