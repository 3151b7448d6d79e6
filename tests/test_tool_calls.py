"""Tool calls end to end: a calculator episode through both clients, against a scripted server and both
real engines; the tool's result comes back as a tool message and carries no loss."""

import asyncio

import pytest
from oracle import oracle_app, serve

from lib.orchestrator.envs import (
    EnvConfig,
    episode_error,
    episode_reward,
    load_env,
    load_tasks,
    model_context,
    run_group,
    serving,
    training_samples,
)
from lib.orchestrator.tasks import sft_conversations
from lib.sampling import SamplingConfig


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


@pytest.mark.slow
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
    from lib.inference import launch
    from lib.inference.weights import reload

    if request.param == "torch":
        log = tmp_path_factory.mktemp("builtin") / "serve.log"
        extra = ["--model.dtype", "float32", "--served-model-name", "policy"]
        with launch.running_server(
            str(tool_caller), engine="torch", log_path=log, extra_args=extra
        ) as server:
            yield server
        return
    server = request.getfixturevalue("vllm_server")
    reload.reload_weights([server.url], tool_caller, None, "tool-caller")
    try:
        yield server
    finally:
        reload.reload_weights([server.url], request.getfixturevalue("trained_tiny"), None, "default")


@pytest.mark.slow
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
