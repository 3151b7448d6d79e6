"""lib/tasks.py: tasks drawn lazily by index, taskset ids and arguments, task ids and SFT conversations."""

import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from lib.envs import EnvConfig, load_env, load_tasks, taskset_args
from lib.tasks import TaskStream, resolve_id, sft_conversations, task_id

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def upstream_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


def test_an_endless_taskset_is_drawn_lazily_with_flat_memory():
    env = EnvConfig(id="plainrl_calculator")
    start = time.perf_counter()
    tasks = load_tasks(load_env(env), env)
    first = tasks[0]
    assert time.perf_counter() - start < 30 and tasks.endless
    tracemalloc.start()
    tasks[10]
    base, _ = tracemalloc.get_traced_memory()
    for index in range(11, 1011):
        tasks[index]
    grown, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert grown - base < 200_000, f"memory grew by {grown - base} bytes over 1000 tasks"
    assert tasks.tasks == [] and first.data.id == "calculator-0" and tasks[1011].data.id == "calculator-1011"


def test_a_finite_taskset_cycles_by_index_and_a_resume_starts_anywhere():
    env = EnvConfig(id="reverse_text", args='{"source": "synthetic"}', num_examples=3)
    vf_env = load_env(env)
    tasks = load_tasks(vf_env, env)
    ids = [tasks[i].data.id for i in range(7)]
    assert ids == ["reverse_text-0", "reverse_text-1", "reverse_text-2"] * 2 + ["reverse_text-0"]
    assert tasks.describe() == "3 examples"
    assert [task.data.id for task in tasks] == ids[:3]  # iterating is one pass, never a cycle
    resumed = load_tasks(vf_env, env)
    assert resumed[4].data.id == "reverse_text-1"  # skipping ahead reads the taskset, in order


def test_alphabet_sort_takes_the_flat_and_the_nested_argument_shapes():
    flat = '{"source": "synthetic", "similarity_power": 8, "power_per_turn": false}'
    nested = '{"source": "synthetic", "task": {"similarity_power": 8, "power_per_turn": false}}'
    for args in (flat, nested):
        env = EnvConfig(id="alphabet_sort", args=args, num_examples=1)
        data = load_tasks(load_env(env), env)[0].data
        assert (data.similarity_power, data.power_per_turn) == (8, False)
    clash = '{"similarity_power": 4, "task": {"similarity_power": 8}}'
    with pytest.raises(ValueError, match="similarity_power is given twice"):
        load_env(EnvConfig(id="alphabet_sort", args=clash))


def test_flat_task_arguments_reach_an_upstream_task_config(upstream_on_path):
    assert taskset_args(EnvConfig(id="upstream_taskset", args='{"exact": false}')) == {
        "task": {"exact": False}
    }
    env = EnvConfig(id="upstream_taskset", args='{"task": {"exact": false}}', num_examples=2)
    assert load_tasks(load_env(env), env)[0].config.exact is False


def test_upstream_shaped_taskset_gives_sft_conversations_and_task_ids(upstream_on_path):
    with pytest.raises(ValueError, match="upstream_taskset is endless"):
        sft_conversations(EnvConfig(id="upstream_taskset"))
    conversations = sft_conversations(EnvConfig(id="upstream_taskset", num_examples=3))
    assert conversations[0][-1]["role"] == "assistant" and conversations[0][-1]["content"].isdigit()
    env = EnvConfig(id="upstream_taskset", num_examples=2)
    assert [task_id(task.data) for task in load_tasks(load_env(env), env)] == ["0", "1"]  # idx, no id
    assert (
        task_id(
            load_tasks(
                load_env(EnvConfig(id="reverse_text", num_examples=1)),
                EnvConfig(id="reverse_text", num_examples=1),
            )[0].data
        )
        == "reverse_text-0"
    )


def test_own_ids_find_plainrl_tasksets_and_an_installed_namesake_wins_with_a_note(
    tmp_path, monkeypatch, capsys
):
    assert resolve_id("reverse_text") == "plainrl_reverse_text"
    assert resolve_id("alphabet-sort") == "plainrl_alphabet_sort"
    assert resolve_id("plainrl_calculator") == "plainrl_calculator"
    (tmp_path / "reverse_text").mkdir()
    (tmp_path / "reverse_text" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "reverse_text", raising=False)
    assert resolve_id("reverse_text") == "reverse_text"
    assert (
        "loading the installed reverse_text module, not plainrl's own (environment id plainrl_reverse_text"
        in capsys.readouterr().err
    )


def test_task_stream_of_an_empty_taskset_says_so():
    stream = TaskStream(iter_taskset([]), "empty")
    with pytest.raises(ValueError, match="environment empty gave no tasks."):
        stream[0]


def iter_taskset(items):
    class Finite(list):
        bounded = True

    return Finite(items)
