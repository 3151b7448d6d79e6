"""lib/inference.py and serve.py's start: engine choice, the default binding, a server that fails to start."""

from pathlib import Path

import pytest
import torch
from conftest import load_script

from lib import inference


def test_auto_engine_picks_vllm_only_with_vllm_and_cuda(monkeypatch):
    import importlib.util

    serve = load_script("serve")
    assert serve.choose_engine("torch") == ("torch", "--engine torch")
    for has_vllm, has_cuda, expected in [
        (False, True, "torch"),
        (True, False, "torch"),
        (True, True, "vllm"),
    ]:
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, v=has_vllm: object() if v else None)
        monkeypatch.setattr(torch.cuda, "is_available", lambda c=has_cuda: c)
        assert serve.choose_engine("auto")[0] == expected


def test_serve_binds_loopback_and_reloads_only_under_outputs_by_default():
    from lib.config import parse

    cfg = parse(load_script("serve").Config, ["--model.name", "outputs/models/tiny"])
    assert cfg.host == "127.0.0.1" and cfg.api_key is None and cfg.weights_root == Path("outputs")


def test_start_server_raises_the_end_of_the_log_when_the_server_exits(tmp_path):
    log = tmp_path / "serve.log"
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 2.*no/such/model") as failed:
        inference.start_server(str(tmp_path / "no/such/model"), engine="torch", log_path=log, timeout=120)
    assert str(log) in str(failed.value)
