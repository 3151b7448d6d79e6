"""sft.py end to end on the tiny model: outputs, exact resume, accumulation, LoRA merge, two CPU processes,
bf16 autocast on CPU."""

import getpass
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, load_script, tensorboard_scalars, wandb_history
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM, AutoTokenizer

from lib.config import parse
from lib.inference import launch

TEXTS = [
    "hello",
    "plain torch",
    "abc def",
    "reverse",
    "tiny model",
    "qwen",
    "x y z",
    "packing",
    "resume",
    "ok",
]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "reverse.jsonl"
    records = [
        {
            "prompt": [{"role": "system", "content": "Reverse."}, {"role": "user", "content": t}],
            "completion": t[::-1],
        }
        for t in TEXTS
    ]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def flags(tiny_dir, data_file, output_dir, *extra) -> list[str]:
    return [
        "--model.name", str(tiny_dir), "--data.id", str(data_file), "--output-dir", str(output_dir),
        "--steps", "4", "--batch-size", "4", "--micro-batch-size", "2", "--seq-len", "64",
        "--optim.lr", "3e-3", "--optim.schedule", "cosine", "--optim.warmup-steps", "1", *extra,
    ]  # fmt: skip


def run(*args) -> dict:
    sft = load_script("sft")
    return sft.main(parse(sft.Config, list(args)))


def losses(history: list[dict]) -> list[float]:
    return [metrics["train/loss"] for metrics in history]


def weights(path) -> dict:
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def test_outputs_config_weights_checkpoints_and_tensorboard(tiny_dir, data_file, tmp_path, capsys):
    out = tmp_path / "run"
    result = run(*flags(tiny_dir, data_file, out, "--checkpoint-every", "2", "--keep-checkpoints", "1"))
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == lines[-1] == f"run dir: {out}"
    assert losses(result["history"])[-1] < losses(result["history"])[0]
    # The summary rl.py ends with too: the loss from first to last step, then where everything is.
    first, last = losses(result["history"])[0], losses(result["history"])[-1]
    summary = "\n".join(lines[-8:])
    assert f"train/loss {first:.3f} -> {last:.3f}" in summary
    for path in ("metrics.jsonl", "loss_curve.png", "weights/step_4", "tb"):
        assert str(out / path) in summary, path
    assert [json.loads(line)["train/loss"] for line in (out / "metrics.jsonl").open()] == pytest.approx(
        losses(result["history"])
    )
    sft = load_script("sft")
    assert parse(sft.Config, ["@", str(out / "config.toml")]).steps == 4
    assert [p.name for p in (out / "weights").iterdir()] == ["step_4"]  # keep 1
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_4"]
    assert json.loads((out / "checkpoints/step_4/progress.json").read_text())["samples_seen"] == 16
    model = AutoModelForCausalLM.from_pretrained(out / "weights/step_4")
    tokenizer = AutoTokenizer.from_pretrained(out / "weights/step_4")
    assert tokenizer.chat_template and model.config.architectures == ["Qwen3ForCausalLM"]
    assert "plainrl" not in (out / "weights/step_4/config.json").read_text()  # no training-only attention
    events = EventAccumulator(str(out / "tb")).Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_second"} <= set(tags)
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="--resume"):  # a second run would mix with the first
        run(*flags(tiny_dir, data_file, out))


def test_the_first_step_prints_its_line_whatever_log_every_says(tiny_dir, data_file, tmp_path, capsys):
    # A slow first step on a busy machine printed nothing until step log_every: the first one always shows.
    run(*flags(tiny_dir, data_file, tmp_path / "run", "--steps", "2", "--log-every", "100"))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 1 and lines[0].startswith("step 1/2  loss "), lines


def test_wandb_offline_logs_every_step_as_tensorboard_does_plus_curve_and_provenance(
    tiny_dir, data_file, tmp_path, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network, whatever the user's settings
    out = tmp_path / "run"
    wandb_flags = ("--wandb.project", "p", "--wandb.name", "n", "--wandb.offline", "--checkpoint-every", "2")
    run(*flags(tiny_dir, data_file, out, *wandb_flags))
    logged, scalars = wandb_history(out), tensorboard_scalars(out)
    assert set(scalars) == set(logged) and scalars["train/loss"].keys() == {1, 2, 3, 4}
    for tag, steps in scalars.items():
        assert logged[tag] == pytest.approx(steps, rel=1e-6), tag  # tensorboard keeps float32
    assert (out / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["packages"]["torch"] == torch.__version__ and provenance["packages"]["transformers"]
    assert len(provenance["plainrl_revision"].removesuffix("-dirty")) == 40
    # A restart sets aside all that the run, wandb and an export wrote (#77 item 4: exported/ stayed).
    from lib import rundir

    export = load_script("export")
    export.main(parse(export.Config, [str(out / "checkpoints" / "step_4")]))
    wrote = {p.name for p in out.iterdir()}
    assert {"wandb", "wandb_id", "exported", "loss_curve.png"} <= wrote, wrote
    moved = rundir.set_aside(out)
    assert sorted(p.name for p in out.iterdir()) == ["base.json", "config.toml", "restarted", "run.lock"]
    assert {p.name for p in moved.iterdir()} == wrote - {"run.lock"}


def test_asking_for_wandb_without_it_installed_fails_at_parse_time_in_one_sentence(tmp_path):
    # sys.modules["wandb"] = None is what an environment without wandb looks like to an import.
    hide_wandb = "import runpy, sys; sys.modules['wandb'] = None; sys.argv.pop(0); runpy.run_path(sys.argv[0], run_name='__main__')"
    for script in ("sft", "rl", "eval"):
        args = [str(ROOT / "scripts" / f"{script}.py"), "--wandb.project", "p", "--wandb.name", "n"]
        result = subprocess.run(
            [sys.executable, "-c", hide_wandb, *args],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=60,
        )
        assert result.returncode == 2 and not (tmp_path / "outputs").exists()  # before any work
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: wandb.project needs the wandb package"), lines
        assert "pip install wandb" in lines[0]


def test_asking_for_wandb_without_a_login_fails_before_any_work_and_offline_mode_goes_on(tmp_path):
    # No key anywhere wandb looks: HOME (~/.netrc, ~/.config/wandb) empty, no WANDB_* variable.
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"} | {
        "HOME": str(home)
    }
    for script in ("sft", "rl", "eval"):
        args = [sys.executable, str(ROOT / "scripts" / f"{script}.py"), "--wandb.project", "p"]
        result = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
        assert result.returncode == 2 and not (tmp_path / "outputs").exists(), result.stderr[-3000:]
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: wandb.project needs a wandb login"), lines
        assert "`wandb login`" in lines[0] and "--wandb.offline" in lines[0], lines
    assert list(home.iterdir()) == []  # the check wrote nothing either
    # WANDB_MODE=offline needs no login: the run goes on, to the next mistake (a model that is not there).
    model = tmp_path / "no-model"
    args = [sys.executable, str(ROOT / "scripts/sft.py"), "--wandb.project", "p", "--model.name", str(model)]
    result = subprocess.run(
        args, capture_output=True, text=True, cwd=tmp_path, env=env | {"WANDB_MODE": "offline"}, timeout=120
    )
    assert result.returncode == 2 and result.stderr.startswith(f"error: model.name {model} "), result.stderr


@pytest.mark.slow
def test_resume_after_a_kill_gives_the_same_losses_and_weights(tiny_dir, data_file, tmp_path, monkeypatch):
    args = ("--steps", "6", "--checkpoint-every", "3")
    full = run(*flags(tiny_dir, data_file, tmp_path / "full", *args))

    import lib.trainer.checkpoint

    save = lib.trainer.checkpoint.save_checkpoint

    def save_then_die(*a, **kw):
        save(*a, **kw)
        raise KeyboardInterrupt  # killed right after the step-3 checkpoint

    monkeypatch.setattr(lib.trainer.checkpoint, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run(*flags(tiny_dir, data_file, tmp_path / "cut", *args))
    monkeypatch.setattr(lib.trainer.checkpoint, "save_checkpoint", save)
    resumed = run(*flags(tiny_dir, data_file, tmp_path / "cut", *args, "--resume"))

    assert len(resumed["history"]) == 3
    assert losses(resumed["history"]) == losses(full["history"])[3:]  # bit for bit
    a, b = weights(tmp_path / "full/weights/step_6"), weights(tmp_path / "cut/weights/step_6")
    assert all(torch.equal(a[k], b[k]) for k in a)
    curve = EventAccumulator(str(tmp_path / "cut/tb")).Reload().Scalars("train/loss")
    assert [event.step for event in curve] == [1, 2, 3, 4, 5, 6]  # one curve across both runs


def test_ctrl_c_checkpoints_the_step_it_is_on_and_resume_continues_it(
    tiny_dir, data_file, tmp_path, monkeypatch
):
    args = ("--steps", "5", "--checkpoint-every", "100")
    full = run(*flags(tiny_dir, data_file, tmp_path / "full", *args))

    import signal

    import lib.orchestrator.data

    batch_indices = lib.orchestrator.data.batch_indices

    def ctrl_c_in_step_2(step, *a):
        if step == 1:
            signal.raise_signal(signal.SIGINT)  # as a terminal's Ctrl-C does, in the middle of step 2
        return batch_indices(step, *a)

    monkeypatch.setattr(lib.orchestrator.data, "batch_indices", ctrl_c_in_step_2)
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN under nohup
    with pytest.raises(KeyboardInterrupt):
        run(*flags(tiny_dir, data_file, tmp_path / "cut", *args))
    assert signal.getsignal(signal.SIGINT) is before  # put back
    assert [p.name for p in (tmp_path / "cut/checkpoints").iterdir()] == ["step_2"]
    monkeypatch.setattr(lib.orchestrator.data, "batch_indices", batch_indices)
    resumed = run(*flags(tiny_dir, data_file, tmp_path / "cut", *args, "--resume"))
    assert losses(resumed["history"]) == losses(full["history"])[2:]  # bit for bit
    a, b = weights(tmp_path / "full/weights/step_5"), weights(tmp_path / "cut/weights/step_5")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_accumulation_packing_and_recomputation_do_not_change_the_step(tiny_dir, data_file, tmp_path):
    one = run(*flags(tiny_dir, data_file, tmp_path / "one", "--micro-batch-size", "4", "--steps", "2"))
    more = ("--micro-batch-size", "1", "--no-packing", "--activation-checkpointing", "--steps", "2")
    accumulated = run(*flags(tiny_dir, data_file, tmp_path / "acc", *more))
    assert losses(accumulated["history"]) == pytest.approx(losses(one["history"]), rel=1e-5)
    a, b = weights(tmp_path / "one/weights/step_2"), weights(tmp_path / "acc/weights/step_2")
    # Adam's first steps divide by |gradient|, so rounding-level gradient differences show up ~1e-5.
    assert all(torch.allclose(a[k], b[k], atol=1e-4) for k in a)


def test_lora_weights_are_merged_into_the_saved_model(tiny_dir, data_file, tmp_path):
    import peft

    out = tmp_path / "lora"
    result = run(*flags(tiny_dir, data_file, out, "--lora.rank", "4", "--lora.alpha", "8", "--steps", "2"))
    adapter = torch.load(out / "checkpoints/step_2/model.pt")
    assert adapter and all("lora_" in key for key in adapter)  # only the adapters are trained and stored
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=load_script("sft").Config().lora.target_modules
    )
    base_plus_adapter = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_dir), config).eval()
    missing = base_plus_adapter.load_state_dict(adapter, strict=False)
    assert not missing.unexpected_keys
    merged = AutoModelForCausalLM.from_pretrained(result["weights"]).eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(tiny_dir)("hello, merged world")["input_ids"]])
    with torch.no_grad():
        expected, actual = base_plus_adapter(ids).logits, merged(ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_dir)(ids).logits
    assert not torch.allclose(base, actual, atol=1e-4)  # the adapters did change the model
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_two_cpu_processes_match_one(tiny_dir, data_file, tmp_path):
    args = flags(tiny_dir, data_file, tmp_path / "two", "--steps", "3", "--micro-batch-size", "1")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    port = str(launch.free_port())  # other test runs may share this machine
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port]
    script = [*torchrun, str(ROOT / "scripts/sft.py"), *args]
    result = subprocess.run(script, capture_output=True, text=True, env=env, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 x cpu" in result.stdout  # FSDP2 over gloo
    one = run(*flags(tiny_dir, data_file, tmp_path / "one", "--steps", "3", "--micro-batch-size", "2"))
    events = EventAccumulator(str(tmp_path / "two/tb")).Reload()
    two_losses = [event.value for event in events.Scalars("train/loss")]
    assert two_losses == pytest.approx(losses(one["history"]), rel=1e-5)
    a, b = weights(tmp_path / "one/weights/step_3"), weights(tmp_path / "two/weights/step_3")
    assert all(torch.allclose(a[k], b[k], atol=1e-4) for k in a)


def test_under_torchrun_a_mistake_s_sentence_ends_what_torchrun_prints(tmp_path):
    # torchrun prints its own traceback (ChildFailedError) after the worker's stderr: the sentence, line 2 of
    # ~35, drowned. The worker writes it to torchrun's error file, which torchrun shows last.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1"]
    torchrun += ["--master-port", str(launch.free_port()), str(ROOT / "scripts/sft.py")]
    model = tmp_path / "no-model"
    for args, sentence in [
        (
            ["--steps", "0"],
            "error: steps, batch_size and micro_batch_size must be >= 1",
        ),  # found by the parse
        (["--model.name", str(model)], f"error: model.name {model} is not a Hugging Face model directory"),
    ]:
        result = subprocess.run(
            [*torchrun, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180
        )
        assert result.returncode != 0 and not (tmp_path / "outputs").exists()
        last = result.stderr.strip().splitlines()[-3:]
        assert any(sentence in line for line in last), result.stderr


@pytest.mark.slow
def test_bf16_autocast_on_cpu_trains_float32_master_weights_and_tracks_float32s_loss(
    tiny_dir, data_file, tmp_path
):
    float32 = run(*flags(tiny_dir, data_file, tmp_path / "float32", "--model.autocast", "off"))
    bf16 = run(*flags(tiny_dir, data_file, tmp_path / "bf16", "--model.autocast", "on"))
    assert losses(bf16["history"])[-1] < losses(bf16["history"])[0]
    # The norms and MLPs compiled (model.compile) fuse their elementwise ops: the same curve within bf16's rounding.
    compiled = run(
        *flags(tiny_dir, data_file, tmp_path / "compiled", "--model.autocast", "on", "--model.compile", "on")
    )
    assert losses(compiled["history"]) == pytest.approx(losses(bf16["history"]), rel=1e-2)
    # bf16 matmuls round differently (so they ran), yet AdamW's float32 updates keep the curve on float32's.
    assert losses(bf16["history"]) != losses(float32["history"])
    assert losses(bf16["history"]) == pytest.approx(losses(float32["history"]), rel=2e-2)
    checkpoint = tmp_path / "bf16/checkpoints/step_4"
    master = torch.load(checkpoint / "model.pt")
    moments = [
        value
        for state in torch.load(checkpoint / "optimizer.pt")["state"].values()
        for key, value in state.items()
        if key != "step"
    ]
    assert master and all(tensor.dtype == torch.float32 for tensor in master.values())
    assert moments and all(tensor.dtype == torch.float32 for tensor in moments)
    # What servers load: the dtype the trainer computes in (runs_in_dtype), float32 without autocast.
    written = load_file(bf16["weights"] / "model.safetensors")
    assert all(tensor.dtype == torch.bfloat16 for tensor in written.values())
    written = load_file(float32["weights"] / "model.safetensors")
    assert all(tensor.dtype == torch.float32 for tensor in written.values())


def test_autocast_auto_is_bf16_on_a_bf16_cpu_for_wide_models_and_forceable_both_ways(monkeypatch):
    from lib.models import load
    from lib.models.load import ModelConfig, trains_in_bf16

    wide, narrow = load.CPU_BF16_MIN_HIDDEN_SIZE, load.CPU_BF16_MIN_HIDDEN_SIZE // 2
    monkeypatch.setattr(load, "cpu_has_bf16", lambda: True)
    assert trains_in_bf16(ModelConfig(), "cpu", hidden_size=wide)
    assert not trains_in_bf16(ModelConfig(), "cpu", hidden_size=narrow)  # autocast's casts outweigh its gain
    assert not trains_in_bf16(ModelConfig(dtype="float32"), "cpu", hidden_size=wide)
    assert not trains_in_bf16(ModelConfig(autocast="off"), "cpu", hidden_size=wide)
    monkeypatch.setattr(load, "cpu_has_bf16", lambda: False)  # emulated bf16 is slower than float32
    assert not trains_in_bf16(ModelConfig(), "cpu", hidden_size=wide)
    assert trains_in_bf16(ModelConfig(autocast="on"), "cpu", hidden_size=narrow)
    assert trains_in_bf16(ModelConfig(), "cuda", hidden_size=narrow)
    assert not trains_in_bf16(ModelConfig(dtype="float32"), "cuda", hidden_size=wide)


def test_compile_auto_is_on_where_bf16_autocast_pays_on_a_cpu_with_a_compiler(monkeypatch):
    import torch._inductor.cpp_builder as builder
    from torch._inductor.exc import InvalidCxxCompiler

    from lib.models import load
    from lib.models.load import ModelConfig
    from lib.trainer.trainable import compiles

    wide, narrow = load.CPU_BF16_MIN_HIDDEN_SIZE, load.CPU_BF16_MIN_HIDDEN_SIZE // 2
    monkeypatch.setattr(builder, "get_cpp_compiler", lambda: "g++")
    assert compiles(ModelConfig(), "cpu", bf16_compute=True, hidden_size=wide)
    assert not compiles(ModelConfig(), "cpu", bf16_compute=True, hidden_size=narrow)  # the tiny model
    assert not compiles(ModelConfig(), "cpu", bf16_compute=False, hidden_size=wide)  # float32: not measured
    assert not compiles(ModelConfig(), "cuda", bf16_compute=True, hidden_size=wide)
    assert not compiles(ModelConfig(compile="off"), "cpu", bf16_compute=True, hidden_size=wide)
    assert compiles(ModelConfig(compile="on"), "cpu", bf16_compute=False, hidden_size=narrow)

    def no_compiler():
        raise InvalidCxxCompiler

    monkeypatch.setattr(builder, "get_cpp_compiler", no_compiler)
    assert not compiles(ModelConfig(), "cpu", bf16_compute=True, hidden_size=wide)


# Compiles the tiny model's first norm and MLP as the trainer does, then runs them forward and backward in
# bf16 autocast at two lengths (dynamic shapes).
COMPILED_NORM_AND_MLP = """
import sys, torch
from lib.models.load import ModelConfig, load_model
from lib.trainer.trainable import compile_norms_and_mlps
model = load_model(ModelConfig(name=sys.argv[1], device="cpu", dtype="float32")).train()
compile_norms_and_mlps(model)
layer = model.model.layers[0]
for length in (7, 33):
    x = torch.randn(1, length, model.config.hidden_size, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer.mlp(layer.post_attention_layernorm(x)).float().sum().backward()
print("trained")
"""


@pytest.mark.slow
def test_a_run_after_one_with_the_cpu_lowered_does_not_load_its_compiled_kernels(tiny_dir, tmp_path):
    """On a CPU with AVX-512, a process lowered to AVX2 (ATEN_CPU_CAPABILITY, docs/testing.md) compiled
    bf16 kernels into inductor's default cache, and the next process that was not lowered loaded them and
    aborted on a corrupted heap ("free(): invalid pointer", "malloc(): unaligned tcache chunk detected").
    On an AVX2-only CPU lowering changes nothing, and this passes without the crash to avoid."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)}  # inductor's default cache: TMPDIR
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    command = [sys.executable, "-c", COMPILED_NORM_AND_MLP, str(tiny_dir)]
    for lowered in (True, False):
        run_env = {**env, "ATEN_CPU_CAPABILITY": "avx2"} if lowered else env
        done = subprocess.run(command, env=run_env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.strip() == "trained", (lowered, done.stderr[-2000:])
    assert sorted(path.name for path in tmp_path.iterdir() if "inductor" in path.name) == [
        "torchinductor_" + getpass.getuser(),
        "torchinductor_" + getpass.getuser() + "-avx2",
    ]


def test_a_model_runs_in_the_dtype_its_trainer_computes_in(monkeypatch):
    """What servers load and trainers write (serve.py and load_trainable both ask runs_in_dtype)."""
    from lib.models import load
    from lib.models.load import ModelConfig, runs_in_dtype

    wide, narrow = load.CPU_BF16_MIN_HIDDEN_SIZE, load.CPU_BF16_MIN_HIDDEN_SIZE // 2
    for native in (True, False):  # both paths, whatever this CPU has
        monkeypatch.setattr(load, "cpu_has_bf16", lambda native=native: native)
        assert runs_in_dtype(ModelConfig(), "cpu", wide) == ("bfloat16" if native else "float32")
        assert runs_in_dtype(ModelConfig(), "cpu", narrow) == "float32"  # the tiny model
        assert runs_in_dtype(ModelConfig(autocast="on"), "cpu", narrow) == "bfloat16"
        assert runs_in_dtype(ModelConfig(autocast="off"), "cpu", wide) == "float32"
        assert runs_in_dtype(ModelConfig(dtype="float32"), "cpu", wide) == "float32"
        assert runs_in_dtype(ModelConfig(dtype="bfloat16"), "cpu", narrow) == "bfloat16"
        assert runs_in_dtype(ModelConfig(), "cuda", narrow) == "bfloat16"
        assert runs_in_dtype(ModelConfig(dtype="float32"), "cuda", wide) == "float32"


def test_benchmarks_name_the_cpu_by_model_and_family_and_count_its_cores():
    import os
    import re
    from pathlib import Path

    from lib.models.load import cpu_name

    text = Path("/proc/cpuinfo").read_text()
    model_name = re.search(r"^model name\s*:\s*(.*)$", text, re.M).group(1).strip()
    family = re.search(r"^cpu family\s*:\s*(\d+)", text, re.M).group(1)
    assert cpu_name().startswith(f"{model_name} (family {family} model ")
    assert cpu_name().endswith(f") x {os.cpu_count()}")


@pytest.mark.parametrize("extra", [[], ["--lora.rank", "4", "--lora.alpha", "8"]], ids=["full", "lora"])
def test_export_writes_a_checkpoint_as_the_hugging_face_directory_the_run_wrote(
    tiny_dir, data_file, tmp_path, extra, capsys
):
    export = load_script("export")
    run(
        *flags(
            tiny_dir,
            data_file,
            tmp_path / "run",
            "--checkpoint-every",
            "2",
            "--micro-batch-size",
            "4",
            *extra,
        )
    )
    out = capsys.readouterr().out
    assert "  1 micro-batch of 4 per rank per step" in out, out
    assert all(len(line) <= 100 for line in out.splitlines() if str(tmp_path.parents[1]) not in line), out
    # weights/step_2 and step_4 are what the run wrote (its last two); the export rebuilds step_2's from its
    # checkpoint alone, LoRA merged.
    checkpoint = tmp_path / "run" / "checkpoints" / "step_2"
    output = export.main(parse(export.Config, [str(checkpoint)]))
    assert output == tmp_path / "run" / "exported" / "step_2"
    written = load_file(tmp_path / "run" / "weights" / "step_2" / "model.safetensors")
    exported = load_file(output / "model.safetensors")
    assert written.keys() == exported.keys()
    for key in written:
        torch.testing.assert_close(exported[key], written[key], rtol=0, atol=0)
    assert (
        AutoTokenizer.from_pretrained(output)("abc").input_ids
        == AutoTokenizer.from_pretrained(tiny_dir)("abc").input_ids
    )
    with pytest.raises(ValueError, match="is not a run's checkpoints/step_N"):
        export.main(parse(export.Config, [str(tmp_path / "run" / "weights" / "step_2")]))
    # An earlier export (its export.json says what it came from) is replaced by the next one.
    assert json.loads((output / "export.json").read_text())["checkpoint"] == str(checkpoint)
    assert export.main(parse(export.Config, [str(checkpoint)])) == output


def fake_run(run_dir, model):
    """A run directory as export.py first reads it (config.toml, checkpoints/step_1/model.pt), with outputs of
    its own beside: enough for what export.py refuses before it loads any weight."""
    (run_dir / "checkpoints" / "step_1").mkdir(parents=True)
    torch.save({}, run_dir / "checkpoints" / "step_1" / "model.pt")
    (run_dir / "config.toml").write_text(f'[model]\nname = "{model}"\n')
    (run_dir / "metrics.jsonl").write_text("{}\n")
    return run_dir / "checkpoints" / "step_1"


def test_export_refuses_an_output_directory_it_did_not_write(tiny_dir, tmp_path, capsys):
    # Seen: --output-dir DIR came back holding only the export (notes.txt and another model were gone); the run
    # directory as --output-dir lost its checkpoints, config.toml, metrics and tb/.
    from lib.config import run_main

    export = load_script("export")
    checkpoint = fake_run(tmp_path / "runs" / "run", tiny_dir)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    (mine / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        run_main(export.main, parse(export.Config, [str(checkpoint), "--output-dir", str(mine)]))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert (
        error.startswith(f"error: --output-dir {mine} holds files export.py did not write")
        and "\n" not in error
    )
    assert "config.json, notes.txt" in error
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "notes.txt"]
    assert (mine / "notes.txt").read_text() == "keep me"
    other_run = tmp_path / "other"
    fake_run(other_run, tiny_dir)
    # The run directory, a folder above it, and another run's directory (its checkpoints/) are refused whole.
    for output in (tmp_path / "runs" / "run", tmp_path / "runs", tmp_path, other_run):
        with pytest.raises(ValueError, match=f"--output-dir {output} holds a run"):
            export.main(parse(export.Config, [str(checkpoint), "--output-dir", str(output)]))
    for run_dir in (tmp_path / "runs" / "run", other_run):
        assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "config.toml", "metrics.jsonl"]


def test_export_replaces_only_an_earlier_export_that_holds_nothing_else(
    tiny_dir, data_file, tmp_path, capsys
):
    # Seen (#77 item 2): any folder with a file named export.json was replaced whole (thesis.tex beside it went),
    # and so was a real earlier export with a README and a results folder added; a symlinked --output-dir got
    # the export, then "Cannot call rmtree on a symbolic link" and a .old-link left behind.
    from lib.config import run_main

    export = load_script("export")
    run(*flags(tiny_dir, data_file, tmp_path / "run", "--steps", "1"))
    checkpoint = tmp_path / "run" / "checkpoints" / "step_1"
    outputs = tmp_path / "outputs"
    mine, earlier, link = outputs / "mine", outputs / "earlier", outputs / "link"
    mine.mkdir(parents=True)
    (mine / "export.json").write_text('{"settings": 1}')
    (mine / "thesis.tex").write_text("thesis")
    older = outputs / "older"  # an export from before export.json listed its files: nothing tells them apart
    older.mkdir()
    (older / "export.json").write_text(json.dumps({"checkpoint": str(checkpoint), "weights": "full weights"}))
    (older / "config.json").write_text("{}")
    assert export.main(parse(export.Config, [str(checkpoint), "--output-dir", str(earlier)])) == earlier
    link.symlink_to(earlier, target_is_directory=True)
    (earlier / "README.md").write_text("notes")
    (earlier / "results").mkdir()
    (earlier / "results" / "scores.csv").write_text("1")

    def files():
        return {str(p.relative_to(outputs)): p.is_symlink() or p.read_bytes() for p in sorted(outputs.rglob("*"))
                if p.is_file() or p.is_symlink()}  # fmt: skip

    before = files()
    refusals = [(mine, "thesis.tex"), (earlier, "README.md, results"), (link, f"to {earlier}")]
    for output, named in [*refusals, (older, "from before export.json listed the files")]:
        with pytest.raises(SystemExit) as exit_info:
            run_main(export.main, parse(export.Config, [str(checkpoint), "--output-dir", str(output)]))
        said = capsys.readouterr().err  # transformers' progress bars, then the one sentence
        error = said.strip().splitlines()[-1]
        assert exit_info.value.code == 2 and "Traceback" not in said, said
        assert error.startswith(f"error: --output-dir {output} ") and named in error, error
        assert files() == before
        assert sorted(p.name for p in outputs.iterdir()) == ["earlier", "link", "mine", "older"]
    # Without what was added, the earlier export is export.py's alone again: the next export replaces it.
    (earlier / "README.md").unlink()
    shutil.rmtree(earlier / "results")
    assert export.main(parse(export.Config, [str(checkpoint), "--output-dir", str(earlier)])) == earlier
    assert (mine / "thesis.tex").read_text() == "thesis"


def rewrite_weights(model_dir) -> bytes:
    """Moves every weight of the model in `model_dir` by 0.5, in place; returns the file's bytes before."""
    from safetensors.torch import save_file

    path = model_dir / "model.safetensors"
    before = path.read_bytes()
    save_file(
        {name: tensor + 0.5 for name, tensor in load_file(path).items()}, path, metadata={"format": "pt"}
    )
    return before


def test_a_lora_run_records_its_base_and_export_and_resume_refuse_another(tiny_dir, data_file, tmp_path):
    # Seen: after the base model was rewritten, export.py merged a LoRA checkpoint onto it and exited 0 with
    # weights 0.5 off the run's own; nothing recorded which base the run trained on.
    import shutil

    from lib.provenance import base_record

    export = load_script("export")
    base, out = tmp_path / "base", tmp_path / "run"
    shutil.copytree(tiny_dir, base)
    lora = ["--lora.rank", "4", "--lora.alpha", "8"]
    run(*flags(base, data_file, out, *lora, "--steps", "1"))
    record = json.loads((out / "base.json").read_text())
    assert record["path"] == str(base) and len(record["sha256"]) == 64
    checkpoint = out / "checkpoints" / "step_1"
    export.main(parse(export.Config, [str(checkpoint)]))  # the base it trained on: merged

    original = rewrite_weights(base)
    with pytest.raises(ValueError) as refused:
        export.main(parse(export.Config, [str(checkpoint)]))
    message, current = str(refused.value), base_record(str(base))["sha256"]
    assert f"{out} trained its LoRA adapters on {base} (weights sha256 {record['sha256'][:16]})" in message
    assert f"{base} now holds other weights (sha256 {current[:16]})" in message and "\n" not in message
    assert json.loads((out / "base.json").read_text()) == record  # the record stays the run's
    with pytest.raises(ValueError, match=f"--resume: {out} trained its LoRA adapters on {base}"):
        run(*flags(base, data_file, out, *lora, "--steps", "2", "--resume"))

    (base / "model.safetensors").write_bytes(original)  # the same weights, written again: a new file time
    assert len(run(*flags(base, data_file, out, *lora, "--steps", "2", "--resume"))["history"]) == 1


def test_a_lora_runs_base_record_covers_its_config_and_an_older_record_its_weights_alone(
    tiny_dir, data_file, tmp_path
):
    # Seen (#77 item 10): base.json hashed the safetensors only: a base whose config.json changed (rms_norm_eps
    # 0.5) after a LoRA run passed export.py and --resume, and the adapters sat on another function.
    export = load_script("export")
    base, out = tmp_path / "base", tmp_path / "run"
    shutil.copytree(tiny_dir, base)
    lora = ["--lora.rank", "4", "--lora.alpha", "8"]
    run(*flags(base, data_file, out, *lora, "--steps", "1"))
    checkpoint = out / "checkpoints" / "step_1"
    original = (base / "config.json").read_text()
    (base / "config.json").write_text(json.dumps({**json.loads(original), "rms_norm_eps": 0.5}))
    with pytest.raises(ValueError) as refused:
        export.main(parse(export.Config, [str(checkpoint)]))
    message = str(refused.value)
    assert message.startswith(f"export: {out} trained its LoRA adapters on {base}") and "\n" not in message
    assert f"{base} now holds another config.json or tokenizer" in message, message
    with pytest.raises(ValueError, match=f"--resume: {out} trained its LoRA adapters on {base}"):
        run(*flags(base, data_file, out, *lora, "--steps", "2", "--resume"))
    assert not (out / "exported").exists() and not (out / "checkpoints" / "step_2").exists()
    # A base.json from before it recorded the config: the config is unknown, the weights are still checked.
    record = json.loads((out / "base.json").read_text())
    del record["config_sha256"]
    (out / "base.json").write_text(json.dumps(record))
    assert export.main(parse(export.Config, [str(checkpoint)])) == out / "exported" / "step_1"
    rewrite_weights(base)
    with pytest.raises(ValueError, match=f"{base} now holds other weights"):
        export.main(parse(export.Config, [str(checkpoint)]))
