"""/pause?mode=keep across a weight reload, on the builtin engine and on real vLLM 0.32 (its CPU build).

A long request is in flight when the server pauses in keep mode and loads other weights. It must
finish, its tokens split into two `weight_versions` spans, each span's logprobs those of its own
weights (scored here by transformers over the whole history). plainrl's reload sequence
(lib/inference/weights/sync.py) must leave no KV of the old weights behind: neither in the kept request (its later
tokens are scored over a history the new weights recomputed) nor for a new request with the same
prompt (vLLM would otherwise reuse the kept request's prefix-cached blocks). The control: a pause
that keeps the cache (clear_cache=false) and a plain /reset_prefix_cache answer success false, and the
kept request then goes on from the old weights' KV.
"""

import functools
import shutil
import threading
import time

import httpx
import pytest
import torch
from conftest import until_decoding

from lib import endpoint
from lib.inference import launch
from lib.inference.weights import reload

PROMPT = [10 + (7 * i) % 80 for i in range(200)]
KEPT_TOKENS = 1200


@pytest.fixture(
    scope="module", params=["builtin", pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.vllm])]
)
def server(request, tmp_path_factory):
    """(base URL, old weights, new weights) of a server serving the old ones, labelled "old"."""
    from lib.models.tiny import TinyConfig, write_tiny

    root = tmp_path_factory.mktemp(f"keep-{request.param}")
    new = write_tiny(root / "new", TinyConfig(seed=1))
    if request.param == "vllm":
        vllm_server, old = request.getfixturevalue("vllm_server"), request.getfixturevalue("trained_tiny")
        reload.reload_weights([vllm_server.url], old, None, "old")
        yield vllm_server.url, old, new
        # The shared server's other users expect trained_tiny under its first label.
        reload.reload_weights([vllm_server.url], old, None, "default")
        return
    old = shutil.copytree(request.getfixturevalue("tiny_dir"), root / "old")
    extra = ["--model.dtype", "float32", "--max-model-len", "2048"]
    with launch.running_server(
        str(old), engine="torch", weights_root=root, log_path=root / "serve.log", extra_args=extra
    ) as builtin:
        reload.reload_weights([builtin.url], old, None, "old")
        yield builtin.url, old, new


@functools.cache
def reference(directory: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def scored(directory, token_ids: list[int]) -> torch.Tensor:
    """The logprobs, at temperature 1, of `token_ids` after PROMPT under the weights in `directory`."""
    ids = torch.tensor([PROMPT + token_ids])
    with torch.no_grad():
        logprobs = reference(str(directory))(ids).logits[0, len(PROMPT) - 1 : -1].log_softmax(-1)  # (T, V)
    return logprobs.gather(-1, torch.tensor(token_ids)[:, None])[:, 0]  # (T,)


def generate(url: str, max_tokens: int) -> dict:
    params = {"max_tokens": max_tokens, "temperature": 1.0, "logprobs": 0, "ignore_eos": True, "seed": 3}
    body = {"model": endpoint.served_model(url), "token_ids": PROMPT, "sampling_params": params}
    answer = httpx.post(endpoint.root_url(url) + "/inference/v1/generate", json=body, timeout=600)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    return {
        "token_ids": choice["token_ids"],
        "logprobs": torch.tensor([entry["logprob"] for entry in choice["logprobs"]["content"]]),
        "spans": [(span["version"], span["start"], span["end"]) for span in choice["weight_versions"]],
    }


def kept_across_reload(url: str, reloading) -> dict:
    """A KEPT_TOKENS request in flight while `reloading()` runs: its answer."""
    generate(url, 4)  # a first request may compile or warm up: not while the clock runs
    began = time.perf_counter()
    generate(url, 100)
    per_token = (time.perf_counter() - began) / 100  # the engines differ by 10x here
    kept = {}
    request = threading.Thread(target=lambda: kept.update(generate(url, KEPT_TOKENS)))
    request.start()
    until_decoding(url)
    # And some of its tokens sampled: the pause lands mid-request. A twelfth of the request at the measured
    # pace: the pace changes with what else runs on the cores (a third once came after the request had ended,
    # on a pytest-xdist worker whose neighbour had gone quiet), and the request goes on for 12x that.
    time.sleep(per_token * KEPT_TOKENS / 12)
    reloading()
    request.join()
    assert len(kept["spans"]) == 2, f"the request was not in flight at the pause: {kept['spans']}"
    (old, start, split), (new, split_again, end) = kept["spans"]
    assert (old, start, split_again, end) == ("old", 0, split, KEPT_TOKENS), kept["spans"]
    assert 0 < split < KEPT_TOKENS, kept["spans"]
    return kept


def test_keep_goes_on_under_the_new_weights_and_leaves_no_old_kv(server):
    url, old, new = server
    kept = kept_across_reload(url, lambda: reload.reload_weights([url], new, None, "new", "keep"))
    ((_, _, split), _) = kept["spans"]
    tokens, logprobs = kept["token_ids"], kept["logprobs"]
    under_old, under_new = scored(old, tokens), scored(new, tokens)
    assert (logprobs[:split] - under_old[:split]).abs().max() < 1e-3  # sampled by the old weights...
    assert (logprobs[split:] - under_new[split:]).abs().max() < 1e-3  # ...then by the new, over new KV
    assert (under_old - under_new).abs().mean() > 0.05  # the two weight sets are told apart
    fresh = generate(url, 4)  # the same prompt: vLLM looks its blocks up in the prefix cache
    assert fresh["spans"] == [("new", 0, 4)]
    assert (fresh["logprobs"] - scored(new, fresh["token_ids"])).abs().max() < 1e-3
    reload.reload_weights([url], old, None, "old")


def test_without_a_reset_the_kept_request_goes_on_from_the_old_kv(server):
    url, old, new = server
    root = endpoint.root_url(url)
    answers = {}

    def reload_keeping_the_cache():
        assert httpx.post(root + "/pause?mode=keep&clear_cache=false").status_code == 200
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(new)}}
        assert httpx.post(root + "/collective_rpc", json=rpc, timeout=600).status_code == 200
        httpx.post(root + "/update_weight_version", json={"new_version": "new"})
        answers["reset"] = httpx.post(root + "/reset_prefix_cache").json()
        assert httpx.post(root + "/resume").status_code == 200

    kept = kept_across_reload(url, reload_keeping_the_cache)
    assert answers["reset"] == {"success": False}  # the kept request still holds its blocks
    ((_, _, split), _) = kept["spans"]
    under_new = scored(new, kept["token_ids"])
    assert (kept["logprobs"][split:] - under_new[split:]).abs().max() > 1e-2  # old KV, new weights
    reload.reload_weights([url], old, None, "old")
