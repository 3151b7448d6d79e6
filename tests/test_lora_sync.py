"""LoRA runs sync the adapter alone: both engines (vLLM's CPU build included) load it at run time and serve it.

LoRA's B starts at zero, so at the start a server that ignores the adapter would look right: the tests
train with a high learning rate and check that what the servers serve after each step is the trainer's
model and is measurably not the base model.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch
from conftest import ROOT, load_script
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lib import endpoint
from lib.config import UserError, parse
from lib.inference import launch
from lib.inference.weights import probing, reload
from lib.models.load import ModelConfig
from lib.trainer.head import use_chunked_head

rl = load_script("rl")
FIXTURES = ROOT / "tests" / "fixtures"
TOLERANCE = 1e-3  # the probe's in float32 (inference.probe_tolerance's default)
LORA = ["--lora.rank", "8", "--lora.alpha", "16", "--optim.lr", "5e-2"]


def run_args(model, out, url, *extra) -> list[str]:
    preset = ["@", str(ROOT / "configs/tiny/rl.toml"), "--model.name", str(model), "--output-dir", str(out)]
    short = ["--examples-per-step", "2", "--rollouts-per-example", "4", "--sampling.max-tokens", "24"]
    short += ["--env.id", "letter_taskset", "--max-async-level", "0", "--inference.urls", url]
    return [*preset, *short, *LORA, *extra]


@pytest.fixture(
    scope="module", params=["torch", pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.vllm])]
)
def lora_server(request, trained_tiny, tmp_path_factory):
    """The base URL of a server of trained_tiny that takes LoRA adapters at run time: a builtin one, or
    the session's shared vLLM server (started with --max-lora-rank too)."""
    if request.param == "vllm":
        url = request.getfixturevalue("vllm_server").url
        # A LoRA run loads only its adapter: the base weights must be trained_tiny's, whatever an earlier
        # test loaded into the shared server.
        reload.reload_weights([url], trained_tiny, None, "default")
        yield url
        return
    root = tmp_path_factory.getbasetemp()
    extra = ["--max-lora-rank", "8", "--model.dtype", "float32"]
    with launch.running_server(
        str(trained_tiny), engine="torch", weights_root=root, log_path=root / "lora.log", extra_args=extra
    ) as server:
        yield server.url


def mean_difference(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b)) / len(a)


@pytest.mark.slow
def test_three_lora_steps_serve_the_trainers_adapter_not_the_base_model(
    lora_server, trained_tiny, tmp_path, monkeypatch
):
    # Each publish: what the server sampled and scored, the trainer's logprobs of those tokens, and the
    # base model's (the adapter switched off in the trainer).
    published = []
    score = probing.trainer_logprobs

    def trainer_logprobs(model, autocast, prompt, completion, *settings):
        with model.disable_adapter():
            base = score(model, autocast, prompt, completion, *settings)
        trainer = score(model, autocast, prompt, completion, *settings)
        published.append({"base": base, "trainer": trainer, "tokens": (prompt, completion)})
        return published[-1]["trainer"]

    compare = probing.compare

    def recorded_compare(probe, trainer, label, tolerance, when):
        published[-1]["served"], published[-1]["label"] = probe.logprobs, label
        return compare(probe, trainer, label, tolerance, when)

    monkeypatch.setattr(probing, "trainer_logprobs", trainer_logprobs)
    monkeypatch.setattr(probing, "compare", recorded_compare)
    out = tmp_path / "run"
    # A learning rate that moves the adapter well past the probe's tolerance in one step (0.3 and 1.2 here),
    # and 8 groups a step, so no step ends all flat: at 2e-2 and 4 groups one machine saw step 3 train on
    # nothing (every group scored 0), which leaves no importance ratio to check.
    flags = ["--steps", "3", "--optim.lr", "1e-2", "--examples-per-step", "8"]
    result = rl.main(parse(rl.Config, run_args(trained_tiny, out, lora_server, *flags)))

    ratios = [m["train/importance_ratio"] for m in result["history"]]
    assert all(abs(r - 1.0) < TOLERANCE for r in ratios[1:]), ratios  # on-policy at steps 2 and 3
    assert [p["label"] for p in published] == ["step_0", "step_1", "step_2", "step_3"]
    for p in published[1:]:
        assert mean_difference(p["served"], p["trainer"]) < TOLERANCE, p
        assert mean_difference(p["served"], p["base"]) >= 10 * TOLERANCE, p  # the adapter is served
    # The servers were asked for the adapter, and weights/step_N holds it alone (PEFT's layout).
    cards = httpx.get(f"{lora_server}/models").json()["data"]
    assert launch.ADAPTER_NAME in [card["id"] for card in cards]
    step_2 = out / "weights" / "step_2"
    assert sorted(p.name for p in step_2.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((step_2 / "adapter_config.json").read_text())["r"] == 8
    # The last step also has the merged model, which is what the run hands on (eval.py, serve.py).
    assert result["weights"] == out / "weights" / "step_3" / "merged"
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(result["weights"], dtype=torch.float32).eval()
    use_chunked_head(merged)
    merged_logprobs = score(merged, contextlib.nullcontext, *published[-1]["tokens"])
    assert mean_difference(merged_logprobs, published[-1]["trainer"]) < TOLERANCE


def test_the_adapter_file_holds_exactly_what_the_trainer_multiplies(tiny_dir, tmp_path):
    """rl.py writes the adapter in the dtype its trainer computes in (lib/models/load.py runs_in_dtype): bf16 only
    under bf16 autocast, which rounds A and B to bf16 at every multiply, so the bf16 file loses nothing the
    trainer uses; a float32 trainer writes float32. Scored with the file's A and B in place of its own, the
    trainer's logprobs stay bit for bit the same (SmolLM2's figures: docs/lora.md)."""
    from safetensors.torch import load_file

    from lib.trainer.servable import write_adapter_dir
    from lib.trainer.trainable import LoraConfig, load_trainable

    prompt, completion = [5, 6, 7, 8], [9, 10, 11, 12, 13, 14]
    for autocast_mode, dtype in (("on", torch.bfloat16), ("off", torch.float32)):
        model, save_dtype, autocast = load_trainable(
            ModelConfig(name=str(tiny_dir), device="cpu", autocast=autocast_mode),
            LoraConfig(rank=16, alpha=32),
            device="cpu",
            world_size=1,
            packing=False,
        )
        assert save_dtype == dtype
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():  # a trained adapter: B is 0 at the start
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
        path = tmp_path / autocast_mode
        path.mkdir()
        write_adapter_dir(path, model, dict(model.state_dict()), save_dtype)
        trainer = probing.trainer_logprobs(model, autocast, prompt, completion)
        written = load_file(path / "adapter_model.safetensors")
        assert {tensor.dtype for tensor in written.values()} == {dtype}
        lora = {name: param for name, param in model.named_parameters() if ".lora_" in name}
        assert len(lora) == len(written)
        moved = [
            bool((param != written[name.replace(".default", "")].float()).any())
            for name, param in lora.items()
        ]
        assert all(moved) if autocast_mode == "on" else not any(moved)  # the file rounded every A and B
        with torch.no_grad():
            for name, param in lora.items():
                param.copy_(written[name.replace(".default", "")].float())
        assert probing.trainer_logprobs(model, autocast, prompt, completion) == trainer


def test_a_server_without_runtime_lora_stops_the_run_in_one_sentence(trained_tiny, tmp_path):
    log = tmp_path / "serve.log"
    with launch.running_server(
        str(trained_tiny), engine="torch", weights_root=tmp_path, log_path=log
    ) as server:
        with pytest.raises(UserError) as stopped:
            rl.main(parse(rl.Config, run_args(trained_tiny, tmp_path / "run", server.url, "--steps", "1")))
    message = str(stopped.value)
    assert "--max-lora-rank 8" in message and "--inference.lora-sync merged" in message, message
    assert "\n" not in message


def scalars(run_dir, tag: str) -> dict[int, float]:
    events = EventAccumulator(str(run_dir / "tb")).Reload()
    return {event.step: event.value for event in events.Scalars(tag)}


@pytest.mark.slow
def test_a_resume_after_kill_9_serves_the_checkpoints_adapter(lora_server, trained_tiny, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    # A step whose groups are all flat trains nothing: at lr 1e-2 the policy collapsed within four steps in
    # one run of six, its step 4 adapter step 3's to the bit, and nothing newer to tell apart. At 4e-3 with
    # flat groups redrawn, no step of six runs was flat and step 4 moved the probe's logprobs by 0.13-0.27.
    flags = ["--steps", "6", "--checkpoint-every", "3", "--keep-weights", "6", "--optim.lr", "4e-3"]
    flags += ["--filter-flat-groups"]
    command = [sys.executable, str(ROOT / "scripts/rl.py"), *run_args(trained_tiny, out, lora_server, *flags)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{FIXTURES}"}
    with open(tmp_path / "job.out", "w") as log:
        job = subprocess.Popen(command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while not (out / "weights" / "step_5").is_dir():  # the server has taken step 4's adapter at least
            assert job.poll() is None, (tmp_path / "job.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "no weights/step_5 after 5 minutes"
            time.sleep(0.01)
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait()
    assert max(int(p.name[5:]) for p in (out / "checkpoints").glob("step_*")) == 3
    # The kill may land inside a reload (at max_async_level 1 it runs beside training), leaving the server
    # paused: every request would wait. The resumed run's first reload resumes it; this test asks first.
    httpx.post(endpoint.root_url(lora_server) + "/resume", timeout=30)
    # The server still serves a newer adapter than the checkpoint's, measurably.
    base = AutoModelForCausalLM.from_pretrained(trained_tiny, dtype=torch.float32)
    use_chunked_head(base)  # the trainer scores tokens through it (lib/trainer/head.py)
    step_3 = PeftModel.from_pretrained(base, out / "weights" / "step_3").eval()
    prompt = rl_tokenizer(trained_tiny).encode(probing.PROBE_TEXT, add_special_tokens=False)
    served = probing.probe(lora_server, launch.ADAPTER_NAME, prompt, None)
    checkpointed = probing.trainer_logprobs(step_3, contextlib.nullcontext, prompt, served.completion_ids)
    assert mean_difference(served.logprobs, checkpointed) >= 10 * TOLERANCE

    # The resumed run loads the checkpoint's adapter first: a server left on the newer one fails its probe.
    resumed = subprocess.run(
        command + ["--resume"], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "(step 3)" in resumed.stdout
    differences = scalars(out, "sync/probe_logprob_difference")
    assert sorted(differences) == [1, 2, 3, 4, 5, 6] and max(differences.values()) < TOLERANCE, differences
    served = probing.probe(lora_server, launch.ADAPTER_NAME, prompt, None)
    assert served.label == "step_6"


def rl_tokenizer(model):
    from lib.models.load import load_tokenizer

    return load_tokenizer(str(model))


@pytest.mark.slow
@pytest.mark.vllm
def test_three_turn_alphabet_sort_trains_a_lora_adapter_through_vllm(vllm_server, trained_tiny, tmp_path):
    turns = '{"min_turns": 3, "max_turns": 3, "min_names_per_turn": 1, "max_names_per_turn": 2}'
    args = run_args(trained_tiny, tmp_path / "run", vllm_server.url, "--steps", "2", "--save-merged")
    args += ["--env.id", "alphabet_sort", "--env.args", turns, "--sampling.max-tokens", "16"]
    result = rl.main(parse(rl.Config, args))
    assert [m["rollouts/errors"] for m in result["history"]] == [0, 0]
    assert all(m["sync/probe_logprob_difference"] < TOLERANCE for m in result["history"]), result["history"]
    records = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step_2.jsonl").open()]
    # The episodes went three turns: a completion holds up to the two later user turns.
    turns = [r["completion"].count("[user]") for r in records]
    assert len(records) >= 8 and 2 in turns and max(turns) == 2, records[0]
    # --save-merged: every step has the merged model beside its adapter, not only the last one.
    assert all(
        (tmp_path / "run" / "weights" / f"step_{n}" / "merged" / "model.safetensors").is_file()
        for n in (1, 2)
    )


@pytest.mark.parametrize("lora_server", ["torch"], indirect=True)
def test_the_builtin_server_refuses_adapters_it_cannot_serve_in_one_sentence(
    lora_server, trained_tiny, tmp_path_factory
):
    import tempfile

    import peft
    from transformers import AutoModelForCausalLM

    def adapter(rank: int, path) -> str:
        base = AutoModelForCausalLM.from_pretrained(trained_tiny)
        peft.get_peft_model(base, peft.LoraConfig(r=rank, target_modules=["q_proj"])).save_pretrained(path)
        return str(path)

    def load(path: str, name: str = "other", inplace: bool = True) -> httpx.Response:
        body = {"lora_name": name, "lora_path": path, "load_inplace": inplace}
        return httpx.post(f"{endpoint.root_url(lora_server)}/v1/load_lora_adapter", json=body, timeout=60)

    root = tmp_path_factory.getbasetemp()
    answer = load(adapter(16, root / "rank-16"))
    assert answer.status_code == 400 and "more than the server's --max-lora-rank 8" in answer.text, (
        answer.text
    )
    with tempfile.TemporaryDirectory() as outside:  # not under the server's weights root
        assert load(adapter(4, outside)).status_code == 403
    small = adapter(4, root / "rank-4")
    assert load(small).status_code == 200
    assert load(small, inplace=False).status_code == 400  # already loaded: in place only, as vLLM
    body = {"model": "unknown", "token_ids": [5, 6], "sampling_params": {"max_tokens": 1}}
    assert httpx.post(f"{endpoint.root_url(lora_server)}/inference/v1/generate", json=body).status_code == 404
