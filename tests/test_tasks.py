"""lib/orchestrator/tasks.py: taskset ids and arguments, synthetic and hub data, tasks drawn lazily by index, task ids, SFT conversations."""

import json
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from lib.models.tiny import CHARACTERS
from lib.orchestrator.envs import load_env, load_tasks
from lib.orchestrator.tasks import (
    EnvConfig,
    TaskStream,
    hf_rows,
    resolve_id,
    sft_conversations,
    task_id,
    taskset_args,
)

FIXTURES = Path(__file__).parent / "fixtures"

SYNTHETIC = '{"source": "synthetic"}'
THREE_TURNS = '{"source": "synthetic", "min_turns": 3, "max_turns": 3}'


def env_texts(conversations: list[list[dict]]) -> str:
    return "".join(m["content"] for c in conversations for m in c)


@pytest.mark.parametrize("env_id,args", [("reverse_text", SYNTHETIC), ("alphabet_sort", THREE_TURNS)])
def test_synthetic_data_is_deterministic_per_seed_and_differs_across_seeds(env_id, args):
    first = sft_conversations(EnvConfig(id=env_id, args=args, num_examples=20, seed=1))
    again = sft_conversations(EnvConfig(id=env_id, args=args, num_examples=20, seed=1))
    other = sft_conversations(EnvConfig(id=env_id, args=args, num_examples=20, seed=2))
    assert first == again
    assert first != other
    assert set(env_texts(first + other)) <= set(CHARACTERS), "every character must be in the tiny vocabulary"


def test_synthetic_reverse_text_respects_the_length_range():
    args = '{"source": "synthetic", "min_chars": 15, "max_chars": 25}'
    conversations = sft_conversations(EnvConfig(id="reverse_text", args=args, num_examples=200))
    lengths = [len(c[1]["content"]) for c in conversations]
    assert min(lengths) >= 15 and max(lengths) <= 25
    assert all(
        c[2]["content"] == f"<reversed_text>\n{c[1]['content'][::-1]}\n</reversed_text>"
        for c in conversations
    )
    assert len({c[1]["content"] for c in conversations}) > 190


def test_alphabet_sort_sft_conversation_alternates_user_and_tagged_answers():
    conversation = sft_conversations(EnvConfig(id="alphabet_sort", args=THREE_TURNS, num_examples=1))[0]
    assert [m["role"] for m in conversation] == ["user", "assistant"] * 3
    assert conversation[1]["content"].startswith("<alphabetical_sorted>\n")
    assert conversation[3]["content"].startswith("<combined_alphabetical_sorted>\n")
    assert "// new name!" in conversation[5]["content"]


def test_hf_source_falls_back_fast_when_offline(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    began = time.perf_counter()
    assert hf_rows("reverse_text", "PrimeIntellect/Reverse-Text-RL", "train", "auto") is None
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1:9")  # nothing listens there: refused at once
    assert hf_rows("reverse_text", "PrimeIntellect/Reverse-Text-RL", "train", "auto") is None
    assert time.perf_counter() - began < 2
    err = capsys.readouterr().err
    assert "synthetic data" in err and max(len(line) for line in err.splitlines()) <= 100, err


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


@pytest.mark.parametrize("script,table", [("rl", "env"), ("sft", "data")])
def test_a_misspelt_env_id_fails_before_servers_start_or_a_run_directory_is_made(
    script, table, tiny_dir, tmp_path
):
    from conftest import load_script

    from lib.config import UserError, parse

    module = load_script(script)
    argv = ["--model.name", str(tiny_dir), f"--{table}.id", "reverse_txt", f"--output-dir={tmp_path / 'run'}"]
    began = time.perf_counter()
    with pytest.raises(UserError, match=r"^environment reverse_txt is not an installed verifiers taskset"):
        module.main(parse(module.Config, argv))
    assert time.perf_counter() - began < 5
    assert not (tmp_path / "run").exists()


def test_env_ids_are_checked_in_mixtures_and_sft_data_may_be_files_or_datasets():
    from lib.orchestrator.data import check_data
    from lib.orchestrator.tasks import check_env_ids

    with pytest.raises(ValueError, match=r"reverse_txt is not .*\(did you mean reverse_text\?\)"):
        check_env_ids(EnvConfig(id="reverse_txt"))
    with pytest.raises(ValueError, match="environment nope is not"):
        check_env_ids(EnvConfig(mix=('{"id": "nope"}',)))
    mix = ('{"id": "plainrl_calculator"}', '{"id": "toy_taskset"}')
    check_env_ids(EnvConfig(id="alphabet-sort", mix=mix))
    # sft.py's data may be a file or a dataset id rather than a taskset.
    check_env_ids(EnvConfig(id="conversations.jsonl"), data=True)
    with pytest.raises(ValueError, match="data file conversations.jsonl does not exist"):
        check_data(EnvConfig(id="conversations.jsonl"))  # sft.py's check reads the file
    check_env_ids(EnvConfig(id="willcb/R1-reverse-wikipedia-paragraphs-v1-1000"), data=True)


def test_an_own_taskset_missing_from_a_source_tree_says_how_to_install_it(monkeypatch):
    # Seen running from a source tree that was never installed: "reverse_text is not an installed verifiers
    # taskset (did you mean reverse_text?)".
    from lib.orchestrator import tasks

    monkeypatch.setattr(tasks, "module_found", lambda name: False)
    with pytest.raises(ValueError) as error:
        tasks.check_env_ids(EnvConfig(id="reverse_text"))
    message = str(error.value)
    assert "did you mean" not in message
    assert "make setup installs" in message and str(Path(tasks.__file__).parent / "tasksets") in message


def test_an_environment_file_gives_tasks_and_sft_conversations_and_its_mistakes_fail_in_one_sentence(
    tmp_path,
):
    from conftest import docs_env_file

    from lib.orchestrator.tasks import check_env_ids

    path = docs_env_file(tmp_path)
    env = EnvConfig(id=str(path), num_examples=3)
    check_env_ids(env)
    assert resolve_id(env.id) == "plainrl_file"
    tasks = list(load_tasks(load_env(env), env).taskset)
    assert len(tasks) == 3 and tasks[0].data.prompt.count("+") == 1
    conversations = sft_conversations(env)
    assert [m["role"] for m in conversations[0]] == ["system", "user", "assistant"]
    a, b = conversations[0][1]["content"].split(" + ")
    assert conversations[0][2]["content"] == str(int(a) + int(b))
    with pytest.raises(ValueError, match="environment file .*nope.py does not exist"):
        check_env_ids(EnvConfig(id=str(tmp_path / "nope.py")))
    broken = tmp_path / "broken.py"
    broken.write_text("def examples():\n    return []\n\ndef reward(completion):\n    return 1.0\n")
    with pytest.raises(
        ValueError,
        match=r"must define examples\(\) and reward\(completion, example\) .*its reward is not that",
    ):
        check_env_ids(EnvConfig(id=str(broken)))


def test_an_environment_file_loads_by_any_path_in_every_script(tmp_path, monkeypatch):
    # Seen: sft.py took an id holding `/` for a hub dataset (RuntimeError: Dataset scripts are no longer
    # supported), so only a bare my_env.py in the working directory worked.
    from conftest import docs_env_file

    from lib.orchestrator.data import check_data, load_conversations
    from lib.orchestrator.tasks import check_env_ids

    (tmp_path / "envs").mkdir()
    path = docs_env_file(tmp_path / "envs")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setenv("HOME", str(tmp_path))
    for given in (str(path), "../envs/my_env.py", "~/envs/my_env.py", "envs/my_env.py"):
        if given == "envs/my_env.py":  # a relative path with directories, from the folder above them
            monkeypatch.chdir(tmp_path)
        env = EnvConfig(id=given, num_examples=2)
        check_env_ids(env)  # rl.py, eval.py
        check_data(env)  # sft.py
        assert [m["role"] for m in load_conversations(env)[0]] == ["system", "user", "assistant"], given
        tasks = list(load_tasks(load_env(env), env).taskset)  # rl.py's and eval.py's episodes
        assert len(tasks) == 2 and tasks[0].data.path == str(path), given


def test_an_environment_files_reward_must_be_a_finite_number(tmp_path):
    # Seen: a reward of NaN trained one step into NaN weights (or broke the group std with a traceback), and
    # the string "1.0" passed as 1.0.
    import asyncio
    import types

    from lib.config import UserError

    path = tmp_path / "rewards.py"
    path.write_text(
        "VALUES = [0.5, True, 2, float('nan'), float('inf'), '1.0', None, 'raise', 'async']\n\n"
        "def examples():\n"
        "    for index, value in enumerate(VALUES):\n"
        "        yield {'prompt': f'p{index}', 'id': f'ex{index}'}\n\n"
        "async def later():\n"
        "    return 0.25\n\n"
        "def reward(completion, example):\n"
        "    value = VALUES[int(example['id'][2:])]\n"
        "    if value == 'raise':\n"
        "        return example['answer']\n"
        "    return later() if value == 'async' else value\n"
    )
    env = EnvConfig(id=str(path))
    tasks = list(load_tasks(load_env(env), env).taskset)
    trace = types.SimpleNamespace(last_reply="a reply")

    def score(index: int) -> float:
        return asyncio.run(tasks[index].file_reward(tasks[index].data, trace))

    assert [score(0), score(1), score(2), score(8)] == [0.5, 1.0, 2.0, 0.25]  # a bool counts as 0 or 1
    for index, shown in [(3, "nan"), (4, "inf"), (5, "'1.0'"), (6, "None")]:
        with pytest.raises(UserError) as error:
            score(index)
        message = str(error.value)
        assert f"environment file {path}: reward(completion, example) returned {shown}" in message, message
        assert f"example ex{index}" in message and "not a finite number" in message, message
        assert "\n" not in message
    with pytest.raises(
        UserError, match=rf"{path}: reward\(completion, example\) raised KeyError: 'answer' on example ex7"
    ):
        score(7)


def test_an_environment_file_with_fewer_examples_than_a_step_takes_is_refused(tmp_path):
    from lib.config import UserError
    from lib.orchestrator.tasks import check_env_ids

    empty, three = tmp_path / "empty.py", tmp_path / "three.py"
    rewards = "\n\ndef reward(completion, example):\n    return 1.0\n"
    empty.write_text("def examples():\n    return []" + rewards)
    three.write_text("def examples():\n    return [{'prompt': str(i)} for i in range(3)]" + rewards)
    with pytest.raises(UserError, match=f"environment file {empty}: its examples\\(\\) gave no examples"):
        check_env_ids(EnvConfig(id=str(empty)))
    with pytest.raises(UserError, match=r"gave 3 examples, and one step takes 4 \(examples_per_step\)"):
        check_env_ids(EnvConfig(id=str(three)), examples_per_step=4)
    with pytest.raises(
        UserError, match=r"env.num_examples takes 2, and one step takes 3 \(examples_per_step\)"
    ):
        check_env_ids(EnvConfig(id=str(three), num_examples=2), examples_per_step=3)
    check_env_ids(EnvConfig(id=str(three)), examples_per_step=3)


def test_an_environment_files_reward_is_any_real_number_that_fits_a_float(tmp_path):
    # Seen: np.isclose's numpy bool, a 0-d array and a torch scalar were refused, where float() took them; and
    # 10**400 escaped as OverflowError, which verifiers counted as a failed rollout instead of ending the run.
    import asyncio
    import types

    from lib.config import UserError

    path = tmp_path / "numeric.py"
    path.write_text(
        "import fractions\n\nimport numpy as np\nimport torch\n\n"
        "VALUES = [np.isclose(1.0, 1.0), np.float32(0.5), np.array(0.25), torch.tensor(0.75), np.int64(2),\n"
        "          fractions.Fraction(1, 4), torch.tensor(True), 10**400, np.array([1.0]), np.float64('nan'),\n"
        "          torch.tensor(float('inf')), 1j]\n\n"
        "def examples():\n"
        "    return [{'prompt': f'p{index}', 'id': f'ex{index}'} for index in range(len(VALUES))]\n\n"
        "def reward(completion, example):\n"
        "    return VALUES[int(example['id'][2:])]\n"
    )
    env = EnvConfig(id=str(path))
    tasks = list(load_tasks(load_env(env), env).taskset)
    trace = types.SimpleNamespace(last_reply="a reply")

    def score(index: int) -> float:
        return asyncio.run(tasks[index].file_reward(tasks[index].data, trace))

    scores = [score(index) for index in range(7)]
    assert scores == [1.0, 0.5, 0.25, 0.75, 2.0, 0.25, 1.0] and {type(s) for s in scores} == {float}
    for index, shown in [(7, "1000000"), (8, "array([1.])"), (9, "nan"), (10, "tensor(inf)"), (11, "1j")]:
        with pytest.raises(UserError) as error:
            score(index)
        message = str(error.value)
        assert f"environment file {path}: reward(completion, example) returned " in message, message
        assert shown in message and f"for example ex{index}" in message and "\n" not in message, message
        assert len(message.replace(str(path), "")) < 250, message  # 10**400's 401 digits are not all shown


def test_an_environment_file_in_a_mixture_needs_only_the_examples_its_share_of_a_step_takes(tmp_path):
    # Seen: a file of 4 examples at a 10% share was refused because "one step takes 8".
    from lib.config import UserError
    from lib.orchestrator.tasks import check_env_ids

    four = tmp_path / "four.py"
    four.write_text(
        "def examples():\n    return [{'prompt': str(i)} for i in range(4)]\n\n"
        "def reward(completion, example):\n    return 1.0\n"
    )
    entry = json.dumps({"id": str(four), "ratio": 1})
    check_env_ids(EnvConfig(id="reverse_text", ratio=9, mix=(entry,)), examples_per_step=8)  # 0.8 a step
    check_env_ids(EnvConfig(id="reverse_text", ratio=1, mix=(entry,)), examples_per_step=8)  # 4 a step
    with pytest.raises(
        UserError, match=r"gave 4 examples, and its share of a step takes 5 \(50% of examples_per_step 10\)"
    ):
        check_env_ids(EnvConfig(id="reverse_text", ratio=1, mix=(entry,)), examples_per_step=10)
    few = json.dumps({"id": str(four), "ratio": 1, "num_examples": 2})
    with pytest.raises(UserError, match=r"env.num_examples takes 2, and its share of a step takes 3"):
        check_env_ids(EnvConfig(id="reverse_text", ratio=2, mix=(few,)), examples_per_step=8)


BROKEN_FILES = {  # an environment file's own bug, what the sentence that ends the run names, and where it is met
    "imports.py": (
        "import no_such_module_of_plainrl\n\ndef examples():\n    return []",
        "failed to import: ModuleNotFoundError",
        "checked",
    ),
    "at_once.py": (
        "def examples():\n    return {}['rows']",
        "its examples() raised KeyError: 'rows'",
        "both",
    ),
    "later.py": (  # its first example is whole: the checks pass, reading on fails
        "def examples():\n    for row in [{'prompt': 'a'}, {}]:\n        yield {'prompt': row['prompt'], 'answer': 'b'}",
        "its examples() raised KeyError: 'prompt'",
        "read",
    ),
}


@pytest.mark.parametrize("name", BROKEN_FILES)
def test_an_environment_file_that_fails_to_import_or_give_examples_is_one_sentence_in_every_script(
    tmp_path, name
):
    """What rl.py and eval.py check before their run directory (check_env_ids) and sft.py (check_data), then
    what sft.py reads (load_conversations) and the episodes' tasks: each ends in one sentence naming the file."""
    from lib.config import UserError
    from lib.orchestrator.data import check_data, load_conversations
    from lib.orchestrator.tasks import check_env_ids

    code, error, where = BROKEN_FILES[name]
    path = tmp_path / name
    path.write_text(code + "\n\ndef reward(completion, example):\n    return 1.0\n")
    env = EnvConfig(id=str(path))
    checks = [lambda: check_env_ids(env), lambda: check_data(env)]
    reads = [lambda: load_conversations(env), lambda: list(load_tasks(load_env(env), env).taskset)]
    for step in {"checked": checks, "read": reads, "both": checks + reads}[where]:
        with pytest.raises(UserError) as refused:
            step()
        message = str(refused.value)
        assert message.startswith(f"environment file {path}") and error in message and "\n" not in message
