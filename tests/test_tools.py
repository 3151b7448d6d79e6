"""Tool calling, the calculator taskset, lazy tasksets, upstream-shaped tasksets, argument shapes and ids."""

import asyncio
import json
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
from oracle import oracle_app, serve

from lib.envs import (
    EnvConfig,
    episode_error,
    episode_reward,
    load_env,
    load_tasks,
    model_context,
    run_group,
    serving,
    taskset_args,
    training_samples,
)
from lib.sampling import SamplingConfig
from lib.tasks import TaskStream, resolve_id, sft_conversations, task_id
from lib.tools import parse_tool_calls

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def upstream_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


@pytest.fixture
def scripted_policy(tiny_dir):
    """Starts a server that plays each conversation's reference turns; yields a function conversations -> URL.

    The oracle answers both clients' routes; point this fixture at another scripted server to run the
    same tests through it.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    with_servers = []

    def start(conversations):
        context = serve(oracle_app(conversations, tokenizer))
        with_servers.append(context)
        return context.__enter__()

    yield start
    for context in reversed(with_servers):
        context.__exit__(None, None, None)


def run(vf_env, task, ctx, num: int):
    async def go():
        async with serving(vf_env):
            return await run_group(vf_env, task, ctx, num)

    return asyncio.run(go())


# ---------------------------------------------------------------- format


def test_tool_call_text_parses_into_content_and_openai_calls():
    text = 'Let me see.<tool_call>{"name": "calculate", "arguments": {"expression": "2*3"}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me see."
    assert [c["function"] for c in calls] == [{"name": "calculate", "arguments": '{"expression": "2*3"}'}]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert parse_tool_calls("<tool_call>{not json}</tool_call> plain") == (
        "<tool_call>{not json}</tool_call> plain",
        [],
    )
    assert parse_tool_calls("no calls here") == ("no calls here", [])


def test_tiny_template_renders_tools_calls_and_results_turn_by_turn(tiny_dir):
    import plainrl_calculator as calc
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    data = calc.CalculatorData(prompt="What is 3*4?", system_prompt="S", expression="3*4", answer="12")
    messages, tools = calc.reference_conversation(data), calc.reference_tools()
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text.startswith('<|im_start|>system\nS\n\nTools:\n<tools>\n{"name": "calculate"')
    assert (
        '<|im_start|>assistant\n<tool_call>{"name": "calculate", "arguments": {"expression": "3*4"}}</tool_call>'
        in text
    )
    assert "<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>" in text
    # The markers are single tokens, and each turn renders as a prefix of the longer conversation.
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<tool_call>") in ids
    for end in range(1, len(messages)):
        part = tokenizer.apply_chat_template(messages[:end], tools=tools, tokenize=True, return_dict=True)
        assert list(ids[: len(part["input_ids"])]) == list(part["input_ids"])
    # A call whose arguments arrive as a JSON string (OpenAI's wire form) renders the same.
    wire = [dict(m) for m in messages]
    wire[2] = {
        **wire[2],
        "tool_calls": [
            {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
            for c in wire[2]["tool_calls"]
        ],
    }
    assert tokenizer.apply_chat_template(wire, tools=tools, tokenize=False) == text


def test_calculator_evaluates_integer_arithmetic_and_refuses_the_rest():
    from plainrl_calculator.tools import calculate

    assert calculate("12*(3+4)") == "84" and calculate("-2-3") == "-5"
    assert calculate("2**100").startswith("error:") and calculate("__import__('os')").startswith("error:")
    assert calculate("1/2").startswith("error:") and calculate("3+").startswith("error:")


# ---------------------------------------------------------------- tool round trip


def check_round_trip(episode, conversation: dict, train: bool, tokenizer) -> None:
    """The episode called `calculate` with the task's expression, got its result back as a tool message,
    answered with it (reward 1); trained on, only the model's own tokens carry loss and logprobs."""
    assert episode_error(episode) is None and episode_reward(episode) == 1.0
    (trace,) = episode.traces
    assert trace.metrics["tool_called"] == 1.0
    tool_messages = [m for m in trace.messages if m.role == "tool"]
    answer = conversation["messages"][-1]["content"]
    assert [m.content for m in tool_messages] == [answer.removeprefix("<answer>").removesuffix("</answer>")]
    samples, error = training_samples(episode)
    assert error is None and len(samples) == (1 if train else 0)
    if train:
        (sample,) = samples
        # SFT data renders the same prompt, tools included, as the episode: what the model learned is what it sees.
        prompt = tokenizer.apply_chat_template(
            conversation["messages"][:2],
            tools=conversation["tools"],
            tokenize=False,
            add_generation_prompt=True,
        )
        assert tokenizer.decode(sample.token_ids).startswith(prompt)
        trained = tokenizer.decode([t for t, m in zip(sample.token_ids, sample.loss_mask) if m])
        untrained = tokenizer.decode([t for t, m in zip(sample.token_ids, sample.loss_mask) if not m])
        expression = conversation["messages"][1]["content"].removeprefix("What is ").removesuffix("?")
        call = (
            f'<tool_call>{{"name": "calculate", "arguments": {{"expression": "{expression}"}}}}</tool_call>'
        )
        assert trained == f"{call}<|im_end|>{answer}<|im_end|>"
        assert "<tool_response>" in untrained and "<tool_response>" not in trained
        assert all((lp != 0.0) == m for lp, m in zip(sample.inference_logp, sample.loss_mask))


@pytest.mark.parametrize("train", [False, True])
def test_tool_round_trip_scores_one_and_tool_results_carry_no_loss(train, scripted_policy, tiny_dir):
    from transformers import AutoTokenizer

    env = EnvConfig(id="plainrl_calculator", num_examples=2)
    vf_env = load_env(env)
    conversations = sft_conversations(env)
    url = scripted_policy(conversations)
    ctx = model_context(url, "oracle", SamplingConfig(max_tokens=256), train=train, tokenizer=tiny_dir)
    (episode,) = run(vf_env, load_tasks(vf_env, env)[1], ctx, 1)
    check_round_trip(episode, conversations[1], train, AutoTokenizer.from_pretrained(tiny_dir))


@pytest.fixture(
    scope="module", params=["torch", pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.vllm])]
)
def engine_playing_tool_caller(request, tool_caller, tmp_path_factory):
    """A real engine serving tool_caller as "policy": the builtin one, or the shared vLLM server with those
    weights loaded (trained_tiny goes back after)."""
    from lib import inference, sync

    if request.param == "torch":
        log = tmp_path_factory.mktemp("builtin") / "serve.log"
        extra = ["--model.dtype", "float32", "--served-model-name", "policy"]
        with inference.running_server(
            str(tool_caller), engine="torch", log_path=log, extra_args=extra
        ) as server:
            yield server
        return
    server = request.getfixturevalue("vllm_server")
    sync.reload_weights([server.url], tool_caller, None, "tool-caller")
    try:
        yield server
    finally:
        sync.reload_weights([server.url], request.getfixturevalue("trained_tiny"), None, "default")


@pytest.mark.parametrize("train", [False, True])
def test_the_tool_round_trip_through_both_engines(train, engine_playing_tool_caller, tiny_dir):
    """The same round trip with a real engine sampling (greedy) from a model that learned the reference
    episodes: the eval client reads tool calls the server parsed (vLLM's hermes parser, the builtin
    engine's own), the train client parses the completion tokens the server returned."""
    from conftest import TOOL_EPISODES
    from transformers import AutoTokenizer

    env = EnvConfig(id="plainrl_calculator", num_examples=TOOL_EPISODES)
    vf_env = load_env(env)
    url = engine_playing_tool_caller.url
    sampling = SamplingConfig(temperature=0.0, max_tokens=128)
    ctx = model_context(url, "policy", sampling, train=train, tokenizer=tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    for task, conversation in zip(load_tasks(vf_env, env), sft_conversations(env), strict=True):
        (episode,) = run(vf_env, task, ctx, 1)
        check_round_trip(episode, conversation, train, tokenizer)


# ---------------------------------------------------------------- lazy tasks


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


def test_eval_refuses_an_endless_taskset_without_n(capsys, tmp_path):
    from conftest import load_script

    eval_script = load_script("eval")
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


# ---------------------------------------------------------------- upstream-shaped tasksets


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


def test_upstream_shaped_taskset_runs_sft_and_eval_with_task_ids(upstream_on_path, scripted_policy, tmp_path):
    from conftest import load_script

    with pytest.raises(ValueError, match="upstream_taskset is endless"):
        sft_conversations(EnvConfig(id="upstream_taskset"))
    conversations = sft_conversations(EnvConfig(id="upstream_taskset", num_examples=3))
    assert conversations[0][-1]["role"] == "assistant" and conversations[0][-1]["content"].isdigit()
    url = scripted_policy(conversations)
    eval_script = load_script("eval")
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
