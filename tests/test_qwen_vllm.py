"""The recipes' path at Qwen3's shapes through real vLLM (its CPU build): a 2-layer Qwen3 with the full
151,936-row vocabulary and tied embeddings goes SFT -> eval -> RL, its chats rendered with the qwen3 renderer.

One vLLM server (float32) serves the SFT output to eval.py and then to rl.py, which reloads it after each step.
The model is tied like Qwen3-0.6B to 4B: vLLM's CPU build refreshes such an output layer only through
lib/inference/weights/vllm_worker.py's ServedWeights, and the weight fingerprint after each reload catches a server still on
the old one. It runs without runtime LoRA, so it also shows what a LoRA run says to such a server.
"""

import json

import pytest
import torch
from conftest import ROOT, load_script
from renderers.qwen3 import Qwen3Renderer
from safetensors.torch import load_file

from lib.config import UserError, parse
from lib.inference import launch
from lib.inference.weights import reload
from lib.models.qwen import QwenConfig, write_qwen
from lib.orchestrator import envs

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
SFT_STEPS = 10


def letter_chats(path):
    """Replies with more and fewer a's, so a briefly trained model answers with a spread of rewards."""
    replies = ["aaa aaa", "a b a", "aaaa", "ab ab", "a a a a", "bab"]
    with open(path, "w") as out:
        for index in range(64):
            chat = [{"role": "user", "content": f"Say aaa {index}."}]
            chat.append({"role": "assistant", "content": replies[index % len(replies)]})
            out.write(json.dumps({"messages": chat}) + "\n")
    return path


def test_a_tied_qwen3_goes_sft_eval_rl_through_vllm_with_the_qwen3_renderer(
    vllm_installed, tmp_path, monkeypatch
):
    base = write_qwen(tmp_path / "qwen3-test", QwenConfig(shape="test", dtype="float32"))
    assert json.loads((base / "config.json").read_text())["tie_word_embeddings"] is True
    sft = load_script("sft")
    sft_args = ["--model.name", str(base), "--data.id", str(letter_chats(tmp_path / "chats.jsonl"))]
    sft_args += ["--output-dir", str(tmp_path / "sft"), "--steps", str(SFT_STEPS), "--batch-size", "8"]
    sft_args += ["--seq-len", "256", "--optim.lr", "1e-3", "--checkpoint-every", str(SFT_STEPS)]
    sft.main(parse(sft.Config, sft_args))
    warmed = tmp_path / "sft" / "weights" / f"step_{SFT_STEPS}"

    rendered_with = []
    init = Qwen3Renderer.__init__
    monkeypatch.setattr(
        Qwen3Renderer, "__init__", lambda self, *a, **k: rendered_with.append("qwen3") or init(self, *a, **k)
    )
    extra = ["--model.dtype", "float32", "--vllm.cpu-kv-cache-gib", "1", "--max-model-len", "1024"]
    extra += ["--served-model-name", "policy"]
    log = tmp_path / "vllm.log"
    with launch.running_server(str(warmed), engine="vllm", log_path=log, extra_args=extra) as server:
        evaluate = load_script("eval")
        eval_args = ["letter_taskset", "-m", "policy", "-b", server.url, "-n", "4", "-r", "2"]
        eval_args += ["--max-tokens", "16", "--output-dir", str(tmp_path / "eval")]
        evaluate.main(parse(evaluate.Config, eval_args))
        summary = json.loads(next((tmp_path / "eval").rglob("summary.json")).read_text())
        assert summary["num_rollouts"] == 8 and summary["num_errors"] == 0, summary

        rl = load_script("rl")
        rl_args = ["@", str(ROOT / "configs/tiny/rl.toml"), "--model.name", str(warmed)]
        rl_args += ["--output-dir", str(tmp_path / "rl"), "--inference.urls", server.url]
        rl_args += ["--env.id", "letter_taskset", "--examples-per-step", "2", "--rollouts-per-example", "4"]
        rl_args += ["--sampling.max-tokens", "16", "--max-async-level", "0", "--steps", "2"]
        # float32 on both sides, as the server: at hidden 256 a bf16 CPU would train under bf16 autocast.
        rl_args += ["--model.dtype", "float32"]
        result = rl.main(parse(rl.Config, rl_args))
        # This server runs without runtime LoRA: a LoRA run stops at its first adapter load, in one sentence.
        with pytest.raises(UserError) as stopped:
            rl.main(parse(rl.Config, [*rl_args, "--output-dir", str(tmp_path / "lora"), "--lora.rank", "8"]))
        message = str(stopped.value)
        assert "answered /v1/load_lora_adapter with 404" in message and "--max-lora-rank 8" in message
        assert "\n" not in message

        # The output layer left unrefreshed, as vLLM's CPU build leaves it without lib/inference/weights/vllm_worker.py's repair:
        # the SFT weights loaded over step 2's, the fingerprint finds it still on step 2's.
        monkeypatch.setattr(reload, "refresh_tied_output_layer", lambda http, url: None)
        with pytest.raises(UserError, match=r"the first differing weight is lm_head\.weight \(sum"):
            reload.reload_weights([server.url], warmed, None, "sft")

    assert envs.renderer_name(str(warmed)) == "qwen3" and rendered_with, "rl.py did not render with qwen3"
    history = result["history"]
    assert len(history) == 2
    # Groups with a spread of rewards, so both steps trained on something.
    assert all(step["rollouts/flat_groups"] < 2 for step in history), history
    # After each reload vLLM scored the probe as the trainer does: its output layer took the new weights.
    assert all(step["sync/probe_logprob_difference"] < 1e-3 for step in history), history
    assert abs(history[0]["train/importance_ratio"] - 1.0) < 1e-3, history[0]
    before = load_file(warmed / "model.safetensors")
    after = load_file(tmp_path / "rl" / "weights" / "step_2" / "model.safetensors")
    assert before.keys() == after.keys() and "lm_head.weight" not in after  # still tied, stored once
    assert not torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
