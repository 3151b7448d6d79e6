"""After every reload each server shows what its engine computes with (lib/inference/weights/fingerprint.py): a server that keeps
other weights, whatever label it reports, stops the run in one sentence naming it and the first weight that
differs. On the builtin engine and on real vLLM (its CPU build, the session's shared server, loaded back with
trained_tiny after this module's tests)."""

import contextlib
import re
import shutil

import pytest
import torch
from conftest import ROOT, load_script
from safetensors.torch import load_file, save_file

from lib import endpoint
from lib.config import UserError, parse
from lib.inference import launch
from lib.inference.weights import fingerprint, probing, reload, sync

rl = load_script("rl")
ENGINES = ["torch", pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.vllm])]


@pytest.fixture(scope="module", params=ENGINES)
def server(request, tiny_dir, tmp_path_factory):
    """(URL, the weights it serves) of a float32 server: a builtin one of the tiny model, of this module's own
    (it loads any directory), or the session's vLLM with trained_tiny."""
    if request.param == "vllm":
        url, served = request.getfixturevalue("vllm_server").url, request.getfixturevalue("trained_tiny")
        yield url, served
        reload.reload_weights([url], served, None, "default")  # as the shared server's other users expect
        return
    log = tmp_path_factory.mktemp("fingerprint") / "serve.log"
    with launch.running_server(
        str(tiny_dir), engine="torch", weights_root="/", log_path=log, extra_args=["--model.dtype", "float32"]
    ) as running:
        yield running.url, tiny_dir


def keep_serving(monkeypatch, directory) -> None:
    """Every reload answers success but loads `directory` instead (its label still changes): the failure the
    probe cannot see in bf16, and what vLLM's CPU build did to a tied output layer."""
    post = reload.post

    def stale(http, url, path, **kwargs):
        body = kwargs.get("json") or {}
        if body.get("method") == "reload_weights":
            kwargs = kwargs | {"json": {**body, "kwargs": {"weights_path": str(directory)}}}
        return post(http, url, path, **kwargs)

    monkeypatch.setattr(reload, "post", stale)


def moved(source, destination, names, step: float = 3e-6):
    """A copy of the weights directory `source` with the weights `names` moved by `step` per entry, as one
    optimizer step at that learning rate moves them."""
    shutil.copytree(source, destination, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(source / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name in names:
        signs = torch.randn(tensors[name].shape, generator=generator).sign()
        tensors[name] = tensors[name] + step * signs.to(tensors[name].dtype)
    save_file(tensors, destination / "model.safetensors", metadata={"format": "pt"})
    return destination


def test_the_fingerprint_sees_one_entry_and_names_the_first_weight_in_the_servers_order():
    weight = torch.randn(151_936, 128, generator=torch.Generator().manual_seed(0)).bfloat16() * 0.02
    column = fingerprint.columns(128)[5].item()
    weight[7, column] = 2**-6
    written = {"model.embed_tokens.weight": fingerprint.of_tensor(weight), "lm_head.weight": [1.0, 1.0]}
    assert fingerprint.first_difference(written, dict(written)) is None
    weight[7, column] = 2**-6 + 2**-13  # one entry of 151,936 x 64 moved by one bf16 step
    served = {"lm_head.weight": [2.0, 2.0], "model.embed_tokens.weight": fingerprint.of_tensor(weight)}
    assert fingerprint.first_difference(written, served) == "lm_head.weight (sum 2 served, 1 written)"
    del served["lm_head.weight"]
    assert fingerprint.first_difference(written, served).startswith("model.embed_tokens.weight (sum")
    assert fingerprint.first_difference(written, {}) == "model.embed_tokens.weight (not served)"


def test_a_reload_that_keeps_the_old_weights_stops_naming_the_server(server, tmp_path, monkeypatch):
    url, served = server
    reload.reload_weights([url], served, None, "default")  # the same weights: nothing to say
    step = moved(served, tmp_path / "step_1", load_file(served / "model.safetensors"))
    keep_serving(monkeypatch, served)
    with pytest.raises(UserError) as stopped:
        reload.reload_weights([url], step, None, "step_1")
    message = str(stopped.value)
    assert message.startswith(
        f"the inference server {endpoint.root_url(url)} does not compute with the weights it loaded from "
        f"{step}: in its engine 0 the first differing weight is model.embed_tokens.weight (sum "
    ), message
    assert "\n" not in message
    assert endpoint.served_model(url)  # resumed: it answers


def test_a_single_changed_weight_is_found_by_name(server, tmp_path, monkeypatch):
    url, served = server
    step = moved(served, tmp_path / "step_1", ["model.layers.1.mlp.down_proj.weight"])
    keep_serving(monkeypatch, served)
    with pytest.raises(
        UserError, match=r"first differing weight is model\.layers\.1\.mlp\.down_proj\.weight "
    ):
        reload.reload_weights([url], step, None, "step_1")


def bf16_run(model, out, url, steps: int):
    """rl.py's arguments for a run in bf16 at the 0.6B preset's learning rate."""
    args = ["@", str(ROOT / "configs/tiny/rl.toml"), "--model.name", str(model), "--output-dir", str(out)]
    args += ["--examples-per-step", "4", "--rollouts-per-example", "4", "--sampling.max-tokens", "16"]
    args += ["--env.id", "letter_taskset", "--max-async-level", "0", "--inference.urls", url]
    args += ["--model.dtype", "bfloat16", "--optim.lr", "3e-6", "--steps", str(steps), "--keep-weights", "8"]
    return parse(rl.Config, args)


def test_a_bf16_run_at_lr_3e_6_passes_and_stops_on_a_stale_server_the_probe_passes(
    server, tiny_dir, tmp_path, monkeypatch
):
    from transformers import AutoModelForCausalLM

    from lib.models.load import load_tokenizer
    from lib.trainer.head import use_chunked_head

    url = server[0]
    result = rl.main(bf16_run(tiny_dir, tmp_path / "run", url, steps=2))
    assert len(result["history"]) == 2

    out = tmp_path / "stale"
    keep_serving(monkeypatch, out / "weights" / "step_0")  # the run's starting weights, loaded at its start
    with pytest.raises(UserError) as stopped:
        rl.main(bf16_run(tiny_dir, out, url, steps=3))
    message = str(stopped.value)
    # At the first step that trained on something (a step whose groups all scored alike moves nothing).
    stale = re.search(r"weights/step_(\d+):", message)
    assert stale and message.startswith(
        f"the inference server {endpoint.root_url(url)} does not compute with the weights it loaded from "
        f"{out / 'weights' / f'step_{stale[1]}'}: in its engine 0 the first differing weight is model."
    ), message
    assert "\n" not in message
    # The step changed the written bf16 weights, yet the probe alone would have let the run go on: the server
    # (still on step 0) and the trainer's weights score its tokens within the bf16 tolerance.
    step = out / "weights" / f"step_{stale[1]}"
    before = load_file(out / "weights" / "step_0" / "model.safetensors")
    after = load_file(step / "model.safetensors")
    assert any(not torch.equal(before[name], after[name]) for name in after)
    prompt = load_tokenizer(str(tiny_dir)).encode(probing.PROBE_TEXT, add_special_tokens=False)
    answer = probing.probe(url, endpoint.served_model(url), prompt, None)
    trainer = AutoModelForCausalLM.from_pretrained(step, dtype=torch.bfloat16).eval()
    use_chunked_head(trainer)
    scored = probing.trainer_logprobs(trainer, contextlib.nullcontext, prompt, answer.completion_ids)
    difference = probing.compare(
        answer, scored, answer.label, probing.BF16_PROBE_TOLERANCE, f"after step {stale[1]}"
    )
    print(f"the probe's mean |logprob difference| from a stale server: {difference:.3g}")


def write_tiny_moe(directory):
    """A tiny random Qwen3-MoE with the tiny model's tokenizer: transformers keeps its experts as fused 3-D
    weights (experts.gate_up_proj, experts.down_proj), and rl.py writes them so."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from lib.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_a_moe_models_expert_weights_are_checked_and_a_stale_expert_is_named(tmp_path, monkeypatch):
    from lib.inference.weights import sync
    from lib.models.load import ModelConfig, load_tokenizer
    from lib.trainer.trainable import LoraConfig, load_trainable

    moe, root = write_tiny_moe(tmp_path / "moe"), tmp_path / "run"
    model, save_dtype, autocast = load_trainable(
        ModelConfig(name=str(moe)), LoraConfig(), device="cpu", world_size=1, packing=True
    )
    assert model.model.layers[0].mlp.experts.down_proj.ndim == 3
    extra_args = ["--model.dtype", "float32"]
    with launch.running_server(
        str(moe), engine="torch", weights_root=root, log_path=tmp_path / "serve.log", extra_args=extra_args
    ) as running:
        servers = sync.Servers([running.url], [endpoint.served_model(running.url)])
        settings = dict(tokenizer=load_tokenizer(str(moe)), save_dtype=save_dtype, autocast=autocast)
        settings |= dict(servers=servers, keep_weights=2, merged=False)
        _, difference = sync.publish(root, 0, model, when="at 0", **settings)
        assert difference < 1e-3
        with torch.no_grad():
            model.model.layers[1].mlp.experts.down_proj[3, 5, 7] += 1e-3  # one entry of one expert moves
        keep_serving(monkeypatch, root / "weights" / "step_0")
        with pytest.raises(
            UserError, match=r"first differing weight is model\.layers\.1\.mlp\.experts\.down_proj \(sum"
        ):
            sync.publish(root, 1, model, when="at 1", **settings)


def test_a_moe_model_is_refused_on_vllms_cpu_build_before_anything_starts(tiny_dir, tmp_path, monkeypatch):
    moe = write_tiny_moe(tmp_path / "moe")
    monkeypatch.setattr(launch, "start_server", lambda *args, **kwargs: pytest.fail("a server started"))
    args = ["@", str(ROOT / "configs/tiny/rl.toml"), "--model.name", str(moe), "--model.device", "cpu"]
    args += ["--output-dir", str(tmp_path / "run"), "--inference.engine", "vllm"]
    with pytest.raises(UserError) as refused:
        rl.main(parse(rl.Config, args))
    message = str(refused.value)
    assert "mixture of experts" in message and "--inference.engine torch" in message, message
    assert "\n" not in message and not (tmp_path / "run").exists()
    # What can work goes on: the builtin engine, LoRA adapters (the weights never reload), a dense model.
    config = parse(rl.Config, args)
    assert sync.weight_sync_mode(config, "cpu", adapter=True) == "disk"
    dense = parse(rl.Config, [*args, "--model.name", str(tiny_dir)])
    assert sync.weight_sync_mode(dense, "cpu", adapter=False) == "memory"
    builtin = parse(rl.Config, [*args, "--inference.engine", "torch"])
    assert sync.weight_sync_mode(builtin, "cpu", adapter=False) == "memory"
