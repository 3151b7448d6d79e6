"""scripts/eval.py: against a server that always answers right, with failing environments, and against the builtin server."""

import contextlib
import dataclasses
import json
from pathlib import Path

import pytest
from conftest import load_script
from oracle import oracle_app, serve

from lib.config import parse, run_main
from lib.inference.launch import free_port
from lib.orchestrator.envs import EnvConfig, sft_conversations

FIXTURES = Path(__file__).parent / "fixtures"
SYNTHETIC = '{"source": "synthetic"}'
THREE_TURNS = '{"source": "synthetic", "min_turns": 3, "max_turns": 3}'
# How long eval.py may take to notice a frozen server: up to 5 s to the next health check, its 5 s timeout
# and stopping a server of its own, twice that on a loaded 2-core machine; one that waits forever never ends.
NOTICE_S = 40.0


@pytest.fixture(scope="module")
def eval_script():
    return load_script("eval")


def evaluate(eval_script, argv: list[str], tmp_path: Path, capsys) -> tuple[dict, list[dict], list[str]]:
    summary = eval_script.main(
        parse(eval_script.Config, [*argv, "--output-dir", str(tmp_path), "--name", "run"])
    )
    run_dir = tmp_path / "run"
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == lines[-1] == f"run dir: {run_dir}"
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    records = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    order = [(r["example"], r["rollout"]) for r in records]
    assert order == sorted(order)  # written as groups finish, in order once all have
    return summary, records, lines


def test_pass_at_k():
    pass_at_k = load_script("eval").pass_at_k
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)


@pytest.mark.parametrize("env_id,args", [("reverse_text", SYNTHETIC), ("alphabet_sort", THREE_TURNS)])
def test_eval_scores_one_against_a_server_that_always_answers_right(
    eval_script, env_id, args, tmp_path, capsys
):
    conversations = sft_conversations(EnvConfig(id=env_id, args=args, num_examples=4))
    with serve(oracle_app(conversations)) as url:
        argv = f"{env_id} -m oracle -b {url} -n 4 -r 2 --max-tokens 64".split() + ["--env-args", args]
        summary, records, _ = evaluate(eval_script, argv, tmp_path, capsys)
    assert summary["avg_reward"] == 1.0 and summary["std_reward"] == 0.0 and summary["perfect_rate"] == 1.0
    assert summary["pass_at_k"] == {"1": 1.0, "2": 1.0}
    assert summary["num_rollouts"] == len(records) == 8 and summary["num_errors"] == 0
    record = records[0]
    assert record["messages"] == record["prompt"] + record["completion"]
    assert [m for m in record["messages"] if m["role"] != "system"] == [
        m for m in conversations[0] if m["role"] != "system"
    ]
    assert record["reward"] == 1.0 and record["num_completion_tokens"] > 0 and "metrics" in record


def test_eval_fails_in_one_sentence_when_every_episode_fails(eval_script, tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    args = '{"fail_in_reward": true}'
    with serve(oracle_app(sft_conversations(EnvConfig(id="toy_taskset")))) as url:
        argv = ["toy_taskset", "-m", "oracle", "-b", url, "-n", "2", "-r", "2", "--env-args", args]
        config = parse(eval_script.Config, [*argv, "--output-dir", str(tmp_path), "--name", "run"])
        with pytest.raises(SystemExit) as exit_info:
            run_main(eval_script.main, config)
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: every one of the 4 episodes failed (first cause: "), last
    assert "toy reward exploded" in last
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["avg_reward"] is None and summary["error_rate"] == 1.0
    assert summary["num_errors"] == summary["num_rollouts"] == 4
    records = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert all("toy reward exploded" in record["error"] for record in records)


def test_eval_against_an_unreachable_server_fails_before_any_episode(eval_script, tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    argv = ["reverse_text", "-m", "oracle", "-b", url, "-n", "2", "--env-args", SYNTHETIC]
    config = parse(eval_script.Config, [*argv, "--output-dir", str(tmp_path), "--name", "run"])
    with pytest.raises(SystemExit) as exit_info:
        run_main(eval_script.main, config)
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot reach the inference server {url} ("), last
    assert not (tmp_path / "run").exists()  # a refused run leaves nothing behind


def test_a_partial_failure_stands_out_with_its_error_rate(eval_script, tmp_path, capsys):
    conversations = sft_conversations(EnvConfig(id="reverse_text", args=SYNTHETIC, num_examples=2))
    # The oracle knows only the first example: it answers the second one's requests with HTTP 500.
    with serve(oracle_app(conversations[:1])) as url:
        argv = ["reverse_text", "-m", "oracle", "-b", url, "-n", "2", "-r", "2", "--env-args", SYNTHETIC]
        summary, records, lines = evaluate(eval_script, argv, tmp_path, capsys)
    assert summary["status"] == "partial" and summary["num_errors"] == 2 and summary["error_rate"] == 0.5
    assert [bool(r["error"]) for r in records] == [False, False, True, True]
    assert summary["avg_reward"] == 0.5  # the failed episodes count as reward 0
    assert any("2 of 4 (50.0%)" in line for line in lines)
    assert any("failed episodes count as reward 0 in the averages" in line for line in lines)


def test_the_server_start_line_names_its_engine_and_stays_on_one_line(
    eval_script, tiny_dir, tmp_path, capsys, monkeypatch
):
    import contextlib

    import lib.inference.launch

    @contextlib.contextmanager
    def not_started(*args, **kwargs):
        raise RuntimeError("the inference server was not started in this test")
        yield

    monkeypatch.setattr(lib.inference.launch, "running_server", not_started)
    # Longer than the 80 columns of a console whose output is no terminal.
    out = tmp_path / ("a-long-directory-name-" * 4)
    argv = ["reverse_text", "-m", str(tiny_dir), "--engine", "vllm", "-n", "1", "--env-args", SYNTHETIC]
    with pytest.raises(SystemExit):
        eval_script.main(parse(eval_script.Config, [*argv, "--output-dir", str(out), "--name", "run"]))
    lines = capsys.readouterr().out.splitlines()
    log = out / "run" / "server.log"
    assert [line for line in lines if line.startswith("starting")] == [
        f"starting a vLLM server for {tiny_dir} (log: {log})"
    ]


def test_an_interrupted_eval_keeps_the_groups_that_finished(request, eval_script, tmp_path, monkeypatch):
    import asyncio
    import signal
    import time

    import lib.orchestrator.envs

    run_group, started, finished = lib.orchestrator.envs.run_group, [], []

    async def interrupted_after_three_groups(*args, **kwargs):
        started.append(1)
        if len(started) <= 3:
            try:
                return await run_group(*args, **kwargs)
            finally:  # a group that fails must not leave the fourth waiting forever
                finished.append(1)
        if len(started) == 4:  # the fourth group waits for the first three, then Ctrl-C
            deadline = time.monotonic() + 120
            while len(finished) < 3:
                assert time.monotonic() < deadline, "the first three groups did not end in 120 s"
                await asyncio.sleep(0.01)
            signal.raise_signal(signal.SIGINT)
        await asyncio.Event().wait()  # the others never finish

    monkeypatch.setattr(lib.orchestrator.envs, "run_group", interrupted_after_three_groups)
    # Ctrl-C raises KeyboardInterrupt here, whatever handler an earlier in-process test left installed.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    with serve(
        oracle_app(sft_conversations(EnvConfig(id="reverse_text", args=SYNTHETIC, num_examples=6)))
    ) as url:
        argv = ["reverse_text", "-m", "oracle", "-b", url, "-n", "6", "-r", "2", "--env-args", SYNTHETIC]
        config = parse(eval_script.Config, [*argv, "--output-dir", str(tmp_path), "--name", "run"])
        with pytest.raises(KeyboardInterrupt):
            eval_script.main(config)
    records = [json.loads(line) for line in (tmp_path / "run/results.jsonl").read_text().splitlines()]
    assert sorted((r["example"], r["rollout"]) for r in records) == [
        (e, r) for e in range(3) for r in range(2)
    ]
    assert all(r["reward"] == 1.0 for r in records)


def test_eval_rejects_bad_input_in_one_sentence(eval_script):
    with pytest.raises(SystemExit):
        parse(eval_script.Config, ["reverse_text", "-b", "http://localhost:8000", "-n", "2"])
    with pytest.raises(SystemExit):
        parse(eval_script.Config, ["reverse_text", "--env-args", "[1, 2]"])
    with pytest.raises(SystemExit):  # a server of its own serves -m already
        parse(eval_script.Config, ["reverse_text", "--reload-weights"])


def test_eval_scores_an_environment_from_one_python_file(eval_script, tmp_path, capsys):
    from conftest import docs_env_file

    path = docs_env_file(tmp_path)
    conversations = sft_conversations(EnvConfig(id=str(path), num_examples=3))
    with serve(oracle_app(conversations)) as url:
        summary, records, _ = evaluate(
            eval_script, [str(path), "-m", "oracle", "-b", url, "-n", "3", "-r", "1"], tmp_path, capsys
        )
    assert summary["avg_reward"] == 1.0 and summary["num_rollouts"] == 3 and summary["num_errors"] == 0


@pytest.mark.slow
def test_eval_against_the_builtin_server_on_the_tiny_model(eval_script, tiny_dir, tmp_path, capsys):
    """Without -b, eval.py starts scripts/serve.py itself (and stops it); then both environments against one server."""
    from lib.inference.launch import running_server

    argv = f"reverse_text -m {tiny_dir} -n 2 -r 2 --max-tokens 8".split() + ["--env-args", SYNTHETIC]
    summary, records, _ = evaluate(eval_script, argv, tmp_path / "own", capsys)
    assert summary["num_rollouts"] == 4 and summary["num_errors"] == 0
    assert all(record["completion"] and record["num_completion_tokens"] > 0 for record in records)

    with running_server(str(tiny_dir), engine="torch", log_path=tmp_path / "server.log") as server:
        argv = f"alphabet_sort -m {tiny_dir} -b {server.url} -n 1 -r 2 --max-tokens 8".split()
        argv += ["--env-args", '{"source": "synthetic", "min_turns": 2, "max_turns": 2}']
        summary, records, _ = evaluate(eval_script, argv, tmp_path / "attached", capsys)
    assert summary["num_rollouts"] == 2 and summary["num_errors"] == 0
    assert all(sum(m["role"] == "assistant" for m in record["messages"]) == 2 for record in records)
    assert 0.0 <= summary["avg_reward"] <= 1.0


def test_start_server_reports_a_server_that_dies(tmp_path):
    from lib.inference.launch import start_server

    with pytest.raises(RuntimeError, match="exited with code"):
        start_server(str(tmp_path / "no_model_here"), engine="torch", log_path=tmp_path / "server.log")


def test_eval_refuses_an_endless_taskset_without_n(eval_script, capsys, tmp_path):
    cfg = eval_script.Config(
        env="plainrl_calculator", num_examples=-1, base_url="http://127.0.0.1:9/v1", output_dir=tmp_path
    )
    with pytest.raises(SystemExit) as exit_info:
        eval_script.main(cfg)
    assert exit_info.value.code == 2
    assert (
        "plainrl_calculator is endless: give the number of examples to evaluate with -n."
        in capsys.readouterr().err
    )
    assert list(tmp_path.iterdir()) == []  # a refused run leaves no run directory behind


def test_eval_of_an_upstream_shaped_taskset_records_task_ids_from_idx(
    eval_script, tiny_dir, tmp_path, monkeypatch
):
    from transformers import AutoTokenizer

    monkeypatch.syspath_prepend(str(FIXTURES))
    conversations = sft_conversations(EnvConfig(id="upstream_taskset", num_examples=3))
    with serve(oracle_app(conversations, AutoTokenizer.from_pretrained(tiny_dir))) as url:
        cfg = eval_script.Config(
            env="upstream_taskset",
            num_examples=3,
            rollouts_per_example=2,
            base_url=url,
            output_dir=tmp_path,
            name="up",
        )
        cfg.model.name = "oracle"
        summary = eval_script.main(cfg)
    assert summary["avg_reward"] == 1.0 and summary["num_errors"] == 0
    records = [json.loads(line) for line in (tmp_path / "up" / "results.jsonl").read_text().splitlines()]
    assert [r["task_id"] for r in records] == ["0", "0", "1", "1", "2", "2"]


def test_held_out_tasks_of_an_upstream_taskset_are_kept_apart_by_idx(monkeypatch):
    """Upstream tasksets set `idx` but no `id`: the split goes by the task id the producer records
    (before, every id was None and rl.py's --eval.every refused them as not unique)."""
    from types import SimpleNamespace

    from lib.orchestrator.envs import load_env, load_tasks
    from lib.orchestrator.evaluation import split_held_out

    monkeypatch.syspath_prepend(str(FIXTURES))
    env = EnvConfig(id="upstream_taskset", num_examples=6)  # endless, bounded to 6
    tasks = list(load_tasks(load_env(env), env))
    assert {task.data.id for task in tasks} == {None}
    train, held_out = split_held_out(tasks, 2)
    assert [task.data.idx for task in train] == [0, 1, 2, 3] and [task.data.idx for task in held_out] == [
        4,
        5,
    ]
    repeated = [SimpleNamespace(data=SimpleNamespace(id=None, idx=i % 3)) for i in range(6)]
    with pytest.raises(ValueError, match=r"task ids are not unique.*\['0', '1', '2'\]"):
        split_held_out(repeated, 3)


@pytest.mark.parametrize("key", [None, "wrong"])
def test_eval_with_a_wrong_or_missing_api_key_stops_before_any_episode(
    eval_script, key, tmp_path, capsys, monkeypatch
):
    """A server that refuses the key would fail every episode; eval.py says so first and makes no run dir."""
    from lib.inference.server.routes import RequireKey

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    if key is None:
        monkeypatch.delenv("PLAINRL_API_KEY", raising=False)
    else:
        monkeypatch.setenv("PLAINRL_API_KEY", key)
    app = oracle_app(sft_conversations(EnvConfig(id="reverse_text", args=SYNTHETIC, num_examples=2)))
    app.add_middleware(RequireKey, expected=b"Bearer right")
    with serve(app) as url:
        argv = ["reverse_text", "-m", "oracle", "-b", url, "-n", "2", "--env-args", SYNTHETIC]
        config = parse(eval_script.Config, [*argv, "--output-dir", str(tmp_path)])
        with pytest.raises(SystemExit) as exit_info:
            run_main(eval_script.main, config)
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    sentence = (
        "the API key is wrong or missing (set $PLAINRL_API_KEY to the server's), or it is no inference server"
    )
    assert err.strip().splitlines()[-1] == f"error: {url}/models answered 401: {sentence}.", err
    assert "run dir" not in out and list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("attached", [True, False], ids=["attached", "own-server"])
def test_eval_ends_in_one_sentence_when_its_server_freezes(
    attached, eval_script, tiny_dir, tmp_path, capsys, caplog, monkeypatch
):
    """A server stopped (SIGSTOP) mid-eval answers nothing: the /health watch rl.py's evaluations use ends
    eval.py too, with `-b` or with a server of its own, instead of waiting forever."""
    import os
    import signal
    import threading
    import time

    import lib.inference.launch

    monkeypatch.delenv("PLAINRL_API_KEY", raising=False)
    servers, start = [], lib.inference.launch.running_server

    @contextlib.contextmanager
    def recorded(*args, **kwargs):
        with start(*args, **kwargs) as server:
            servers.append(server)
            yield server

    monkeypatch.setattr(lib.inference.launch, "running_server", recorded)
    argv = ["reverse_text", "-m", str(tiny_dir), "-n", "1000", "-r", "1", "--max-concurrent", "4"]
    argv += ["--max-tokens", "16", "--env-args", SYNTHETIC, "--output-dir", str(tmp_path), "--name", "run"]
    ended = {}

    def evaluate():
        try:
            run_main(eval_script.main, parse(eval_script.Config, argv))
        except SystemExit as exit_info:
            ended["code"] = exit_info.code

    with contextlib.ExitStack() as stack:
        if attached:
            attached_server = stack.enter_context(
                recorded(str(tiny_dir), engine="torch", log_path=tmp_path / "b.log")
            )
            argv += ["-b", attached_server.url]
        thread = threading.Thread(target=evaluate, daemon=True)  # it would wait forever on the frozen server
        thread.start()
        results, deadline = tmp_path / "run" / "results.jsonl", time.monotonic() + 300
        while not (results.is_file() and results.read_text()):  # a group has finished: mid-run
            assert thread.is_alive() and time.monotonic() < deadline, ended
            time.sleep(0.05)
        server = servers[0]
        os.killpg(server.process.pid, signal.SIGSTOP)
        stack.callback(
            lambda: server.process.poll() is None and os.killpg(server.process.pid, signal.SIGCONT)
        )
        frozen = time.monotonic()
        thread.join(NOTICE_S)
        seconds = time.monotonic() - frozen
        assert not thread.is_alive(), (
            f"eval.py still waited on a frozen server {NOTICE_S:.0f} s after SIGSTOP"
        )
    last = capsys.readouterr().err.strip().splitlines()[-1]
    root = server.url.removesuffix("/v1")
    assert (
        ended["code"] == 2
        and last == f"error: the inference server {root} did not answer /health within 5 s (is it frozen?)."
    ), last
    # No traceback of the episodes cut short (asyncio logs one per episode left open at its shutdown).
    assert not [record.getMessage() for record in caplog.records if record.name == "asyncio"]
    with capsys.disabled():
        print(f"\neval.py ended {seconds:.1f} s after its server froze: {last}")


def changed_copy(model: Path, to: Path) -> Path:
    """A copy of the model directory `model` with one weight moved, as a training step would."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, to)
    [file] = to.glob("*.safetensors")
    weights = load_file(file)
    weights["model.norm.weight"] += 0.25
    save_file(weights, file, metadata={"format": "pt"})
    return to


@pytest.mark.slow
def test_eval_stops_when_the_server_computes_with_other_weights_than_m(
    eval_script, tiny_dir, tmp_path, capsys
):
    """A server that another run loaded its weights into still answers to the name it was started with:
    eval.py compares the weights it computes with against -m's, records what it found, and stops before any
    episode when they differ; with --reload-weights it loads -m into the server instead."""
    import shutil

    from lib.inference.launch import running_server
    from lib.inference.weights.reload import reload_weights

    started, trained = tmp_path / "sft" / "step_40", changed_copy(tiny_dir, tmp_path / "rl" / "step_3")
    shutil.copytree(tiny_dir, started)
    log = tmp_path / "server.log"
    with running_server(str(started), engine="torch", weights_root=tmp_path, log_path=log) as server:
        reload_weights([server.url], trained, None, "step_3")  # what an attached rl.py run does
        argv = f"reverse_text -m {started} -b {server.url} -n 1 -r 1 --max-tokens 4".split()
        config = parse(
            eval_script.Config, [*argv, "--env-args", SYNTHETIC, "--output-dir", str(tmp_path / "other")]
        )
        with pytest.raises(SystemExit) as exit_info:
            run_main(eval_script.main, config)
        assert exit_info.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        root = server.url.removesuffix("/v1")
        assert last.startswith(
            f"error: the inference server {root} does not compute with the weights in {started} (-m): its "
            "first differing weight is model.norm.weight (sum "
        ), last
        assert not (tmp_path / "other").exists()  # stopped before its run directory

        argv += ["--reload-weights", "--env-args", SYNTHETIC]
        summary, _, _ = evaluate(eval_script, argv, tmp_path / "reloaded", capsys)
    checked = f"the weights in {started}: every weight's fingerprint, in float32 (loaded by --reload-weights)"
    assert summary["served_weights"] == checked and summary["num_errors"] == 0
    provenance = json.loads((tmp_path / "reloaded" / "run" / "provenance.json").read_text())
    assert provenance["servers"][0]["weights"] == checked


@pytest.mark.slow
@pytest.mark.vllm
def test_eval_checks_what_a_vllm_server_computes_with(
    eval_script, vllm_server, trained_tiny, tmp_path, capsys
):
    """vLLM shows the weights it computes with through plainrl's worker extension (lib/inference/weights/vllm_worker.py), as
    the builtin engine does: eval.py records them, or stops when they are not -m's."""
    from lib.inference.weights.reload import check_serves

    served = check_serves(vllm_server.url, trained_tiny, None)
    assert served == f"the weights in {trained_tiny}: every weight's fingerprint, in float32"
    moved = changed_copy(trained_tiny, tmp_path / "moved")
    argv = f"reverse_text -m {moved} -b {vllm_server.url} -n 1 -r 1 --env-args".split() + [SYNTHETIC]
    with pytest.raises(SystemExit) as exit_info:
        run_main(eval_script.main, parse(eval_script.Config, [*argv, "--output-dir", str(tmp_path / "out")]))
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    root = vllm_server.url.removesuffix("/v1")
    assert last.startswith(
        f"error: the inference server {root} does not compute with the weights in {moved} (-m): its first "
        "differing weight is model.norm.weight (sum "
    ), last
    assert not (tmp_path / "out").exists()


def test_eval_of_an_environment_file_whose_reward_is_text_ends_in_one_sentence(eval_script, tmp_path):
    # Seen: a reward returning the string "1.0" was taken as 1.0.
    path = tmp_path / "text_reward.py"
    path.write_text(
        "def examples():\n    return [{'prompt': 'a', 'answer': 'b', 'id': 'first'}]\n\n"
        "def reward(completion, example):\n    return '1.0'\n"
    )
    conversations = sft_conversations(EnvConfig(id=str(path)))
    with serve(oracle_app(conversations)) as url:
        config = parse(eval_script.Config, [str(path), "-m", "oracle", "-b", url, "-n", "1", "-r", "1"])
        with pytest.raises(
            ValueError, match=rf"{path}: reward\(completion, example\) returned '1.0' for example first"
        ):
            eval_script.main(dataclasses.replace(config, output_dir=tmp_path / "out"))


def test_an_environment_file_that_fails_to_import_or_to_give_examples_ends_eval_in_one_sentence(
    eval_script, tmp_path, capsys
):
    # Seen: eval.py printed the ModuleNotFoundError's or the KeyError's traceback, where docs/environments.md
    # promises one sentence naming the file.
    reward = "\n\ndef reward(completion, example):\n    return 1.0\n"
    files = {
        "imports.py": (
            "import no_such_module_of_plainrl\n\ndef examples():\n    return []" + reward,
            "ModuleNotFoundError",
        ),
        "at_once.py": ("def examples():\n    return {}['rows']" + reward, "KeyError: 'rows'"),
        "later.py": (
            "def examples():\n    for row in [{'prompt': 'a'}, {}]:\n        yield {'prompt': row['prompt']}"
            + reward,
            "KeyError: 'prompt'",
        ),
    }
    for name, (code, error) in files.items():
        (tmp_path / name).write_text(code)
        out = tmp_path / "out"
        argv = [str(tmp_path / name), "-b", "http://127.0.0.1:9/v1", "-n", "2", "--output-dir", str(out)]
        with pytest.raises(SystemExit) as exit_info:
            run_main(eval_script.main, parse(eval_script.Config, argv))
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "Traceback" not in err, err
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"error: environment file {tmp_path / name}") and error in last, last
        assert not out.exists()  # nothing left behind


@pytest.mark.slow
def test_eval_asks_an_attached_server_the_name_it_answers_to(
    eval_script, tiny_dir, tmp_path, capsys, monkeypatch
):
    """A server answers to the name it was started with: -m spelled otherwise (./DIR), or another checkpoint
    that --reload-weights loads into it, is sent under the server's name, not -m's (seen: a 404 on every episode)."""
    import shutil

    from lib.inference.launch import running_server

    monkeypatch.chdir(tmp_path)
    started, trained = tmp_path / "sft" / "step_60", changed_copy(tiny_dir, tmp_path / "rl" / "step_8")
    shutil.copytree(tiny_dir, started)
    with running_server(
        str(started), engine="torch", weights_root=tmp_path, log_path=tmp_path / "log"
    ) as server:
        respelled = "./sft/step_60"
        argv = f"reverse_text -m {respelled} -b {server.url} -n 1 -r 2 --max-tokens 4".split()
        summary, _, _ = evaluate(
            eval_script, [*argv, "--env-args", SYNTHETIC], tmp_path / "respelled", capsys
        )
        assert summary["num_errors"] == 0 and summary["model"] == respelled

        argv = f"reverse_text -m {trained} -b {server.url} -n 1 -r 2 --max-tokens 4 --reload-weights".split()
        summary, _, _ = evaluate(eval_script, [*argv, "--env-args", SYNTHETIC], tmp_path / "reloaded", capsys)
    assert summary["num_errors"] == 0 and summary["served_weights"].endswith("(loaded by --reload-weights)")


@pytest.mark.slow
def test_eval_of_a_name_the_server_does_not_serve_stops_before_any_episode(
    eval_script, tiny_dir, tmp_path, capsys
):
    from lib.inference.launch import running_server

    with running_server(str(tiny_dir), engine="torch", log_path=tmp_path / "server.log") as server:
        argv = f"reverse_text -m Qwen/Qwen3-0.6B -b {server.url} -n 1 -r 1 --env-args".split() + [SYNTHETIC]
        config = parse(eval_script.Config, [*argv, "--output-dir", str(tmp_path / "out")])
        with pytest.raises(SystemExit) as exit_info:
            run_main(eval_script.main, config)
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    root = server.url.removesuffix("/v1")
    assert err.strip().splitlines()[-1] == (
        f"error: the inference server {root} answers to {tiny_dir}, not Qwen/Qwen3-0.6B (-m): give -m that "
        "name, or the local directory it serves."
    ), err
    assert "run dir" not in out and not (tmp_path / "out").exists()


def test_eval_whose_own_server_fails_to_start_leaves_no_run_directory(
    eval_script, tiny_dir, tmp_path, capsys
):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # a directory that looks like a model but is none
    argv = ["reverse_text", "-m", str(broken), "--engine", "torch", "-n", "1", "--env-args", SYNTHETIC]
    config = parse(eval_script.Config, [*argv, "--output-dir", str(tmp_path / "out"), "--name", "run"])
    with pytest.raises(SystemExit) as exit_info:
        run_main(eval_script.main, config)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: the inference server exited with code" in err and "end of its log" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags,warned",
    [
        (["-r", "2", "--sampling.temperature", "0"], True),
        (["-r", "2", "--sampling.top-k", "1"], True),  # greedy too, as kept-set servers need it
        (["-r", "1", "--sampling.temperature", "0"], False),
        (["-r", "2", "--sampling.temperature", "1"], False),
    ],
)
def test_greedy_rollouts_of_one_example_are_said_to_be_identical(
    eval_script, flags, warned, tmp_path, capsys
):
    """`make eval ENV=tiny R=3` ran three identical greedy rollouts an example and said nothing."""
    conversations = sft_conversations(EnvConfig(id="reverse_text", args=SYNTHETIC, num_examples=1))
    with serve(oracle_app(conversations)) as url:
        argv = ["reverse_text", "-m", "oracle", "-b", url, "-n", "1", *flags, "--env-args", SYNTHETIC]
        eval_script.main(parse(eval_script.Config, [*argv, "--output-dir", str(tmp_path), "--name", "run"]))
    lines = [line for line in capsys.readouterr().err.splitlines() if "identical" in line]
    rollouts = flags[1]
    expected = [
        f"WARNING: {rollouts} rollouts an example at temperature 0 (or top_k 1) are identical, and pass@{rollouts} "
        "is pass@1: pass --sampling.temperature 1.0 to sample them, or -r 1"
    ]
    assert lines == (expected if warned else []), lines


@pytest.mark.parametrize("owner", ["vllm", "openai"])
def test_the_name_requests_give_is_the_servers_for_a_directory_and_m_where_it_lists_it(owner, tmp_path):
    """What lib/endpoint.py request_name answers a vLLM server (as the builtin one) and a hosted API."""
    from fastapi import FastAPI

    from lib.config import UserError
    from lib.endpoint import request_name

    app = FastAPI()
    listed = [{"id": "Qwen/Qwen3-0.6B", "owned_by": owner}, {"id": "adapter", "owned_by": owner}]
    app.get("/v1/models")(lambda: {"object": "list", "data": listed})
    with serve(app) as url:
        assert request_name(url, "adapter") == "adapter"  # listed: as given
        assert request_name(url, str(tmp_path)) == "Qwen/Qwen3-0.6B"  # a directory: the server's name
        if owner == "vllm":
            with pytest.raises(UserError, match="answers to Qwen/Qwen3-0.6B, adapter, not gpt-4o"):
                request_name(url, "gpt-4o")
        else:  # a hosted API's own error says more
            assert request_name(url, "gpt-4o") == "gpt-4o"
