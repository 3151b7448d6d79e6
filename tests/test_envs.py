"""Environments: loading by id, episodes through both clients, and the rollouts they give."""

import asyncio
import contextlib
import select
import socket
import threading
from pathlib import Path

import pytest
from oracle import oracle_app, serve

from lib.orchestrator.envs import (
    episode_error,
    episode_reward,
    load_env,
    load_tasks,
    model_context,
    run_group,
    serving,
    training_samples,
)
from lib.orchestrator.tasks import EnvConfig, sft_conversations
from lib.sampling import SamplingConfig

FIXTURES = Path(__file__).parent / "fixtures"
SYNTHETIC = '{"source": "synthetic"}'
THREE_TURNS = '{"source": "synthetic", "min_turns": 3, "max_turns": 3}'


@pytest.fixture
def toy_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


def run(vf_env, task, ctx, num: int):
    async def go():
        async with serving(vf_env):
            return await run_group(vf_env, task, ctx, num)

    return asyncio.run(go())


# ---------------------------------------------------------------- loading


def test_synthetic_alphabet_sort_turns_names_and_order():
    args = '{"source": "synthetic", "min_turns": 1, "max_turns": 3, "min_names_per_turn": 2, "max_names_per_turn": 4}'
    vf_env = load_env(EnvConfig(id="alphabet_sort", args=args, num_examples=100))
    datas = [task.data for task in load_tasks(vf_env, EnvConfig(num_examples=100))]
    assert {len(d.turns) for d in datas} == {1, 2, 3}
    assert all(2 <= len(names) <= 4 for d in datas for names in d.turns)
    assert {d.by_first for d in datas} == {True, False}
    for d in datas:
        names = [n for turn in d.turns for n in turn]
        assert len({n[: next(i for i in range(1, len(n)) if n[i].isupper())] for n in names}) == len(names)
        assert ("FIRST" if d.by_first else "LAST") in d.user_turns[0]
        assert len(d.user_turns) == len(d.expected) == len(d.turns)


def test_bad_taskset_arguments_fail_in_one_sentence():
    with pytest.raises(ValueError, match="min_turns <= max_turns"):
        load_env(EnvConfig(id="alphabet_sort", args='{"min_turns": 4, "max_turns": 2}'))
    with pytest.raises(ValueError, match="bad arguments for environment reverse_text"):
        load_env(EnvConfig(id="reverse_text", args='{"no_such_argument": 1}'))
    with pytest.raises(ValueError, match="not an installed verifiers taskset"):
        load_env(EnvConfig(id="no_such_taskset_here"))


def test_third_party_taskset_loads_by_id(toy_on_path):
    vf_env = load_env(EnvConfig(id="toy_taskset", args='{"num_examples": 3}'))
    tasks = load_tasks(vf_env, EnvConfig(id="toy_taskset"))
    assert [task.data.word for task in tasks] == ["hello", "bonjour", "hola"]
    assert len(sft_conversations(EnvConfig(id="toy_taskset", num_examples=2))) == 2


# ---------------------------------------------------------------- episodes


@pytest.mark.parametrize("env_id,args", [("reverse_text", SYNTHETIC), ("alphabet_sort", THREE_TURNS)])
def test_perfect_answers_score_one_through_both_clients(env_id, args, tiny_dir):
    from transformers import AutoTokenizer

    env = EnvConfig(id=env_id, args=args, num_examples=2)
    vf_env = load_env(env)
    tasks = load_tasks(vf_env, env)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    with serve(oracle_app(sft_conversations(env), tokenizer)) as url:
        for train in (False, True):
            ctx = model_context(
                url, "oracle", SamplingConfig(max_tokens=512), train=train, tokenizer=tiny_dir
            )
            episodes = run(vf_env, tasks[1], ctx, 2)
            assert [episode_error(e) for e in episodes] == [None, None]
            assert [episode_reward(e) for e in episodes] == [1.0, 1.0]
            samples, error = training_samples(episodes[0])
            assert error is None and len(samples) == (1 if train else 0)  # the eval client carries no tokens


def test_training_samples_hold_the_exact_tokens_with_user_turns_masked(tiny_dir):
    from transformers import AutoTokenizer

    env = EnvConfig(id="alphabet_sort", args=THREE_TURNS, num_examples=1)
    vf_env = load_env(env)
    conversation = sft_conversations(env)[0]
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    with serve(oracle_app([conversation], tokenizer)) as url:
        ctx = model_context(url, "oracle", SamplingConfig(max_tokens=512), train=True, tokenizer=tiny_dir)
        (episode,) = run(vf_env, load_tasks(vf_env, env)[0], ctx, 1)
    (sample,), error = training_samples(episode)
    assert error is None and sample.reward == 1.0
    assert len(sample.token_ids) == len(sample.loss_mask) == len(sample.inference_logp)
    # The whole episode is the chat template over the conversation: nothing re-tokenized differently.
    rendered = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"]
    assert sample.token_ids == list(rendered)[: len(sample.token_ids)]
    # Trained tokens: exactly each assistant reply plus its end-of-turn token; user turns are masked.
    trained = tokenizer.decode([t for t, m in zip(sample.token_ids, sample.loss_mask) if m])
    replies = [m["content"] for m in conversation if m["role"] == "assistant"]
    assert trained == "".join(reply + "<|im_end|>" for reply in replies)
    assert all((lp != 0.0) == m for lp, m in zip(sample.inference_logp, sample.loss_mask))


def test_a_turn_cut_by_a_token_limit_truncates_every_rollout_of_its_episode(tiny_dir):
    """verifiers' Trace.is_truncated looks at the last turn only; a rollout is truncated when any turn of its
    episode was cut (all its branches: they share its reward), and records why each turn ended."""
    from transformers import AutoTokenizer

    env = EnvConfig(id="alphabet_sort", args=THREE_TURNS, num_examples=1)
    vf_env = load_env(env)
    conversation = sft_conversations(env)[0]
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    for cut_turns, truncated in (((), False), ((0,), True)):
        with serve(oracle_app([conversation], tokenizer, cut_turns=cut_turns)) as url:
            ctx = model_context(url, "oracle", SamplingConfig(max_tokens=512), train=True, tokenizer=tiny_dir)
            (episode,) = run(vf_env, load_tasks(vf_env, env)[0], ctx, 1)
        samples, error = training_samples(episode)
        assert error is None and samples and not episode.traces[0].is_truncated
        expected = ["length" if turn in cut_turns else "stop" for turn in range(3)]
        assert [(s.finish_reasons, s.truncated) for s in samples] == [(expected, truncated)] * len(samples)


def test_a_turn_whose_kept_sets_do_not_match_its_tokens_leaves_its_rollout_without_any(tiny_dir):
    """verifiers drops a turn's sampling_mask whose rows do not match the turn's tokens, and the rollout then
    carries no kept sets at all (a run that needs them leaves its group out: lib/orchestrator/producer.py)."""
    from transformers import AutoTokenizer

    env = EnvConfig(id="alphabet_sort", args=THREE_TURNS, num_examples=1)
    vf_env = load_env(env)
    conversation = sft_conversations(env)[0]
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    for gaps, whole in (((), True), ((1,), False)):
        app = oracle_app([conversation], tokenizer, kept_sets=True, kept_set_gaps=gaps)
        with serve(app) as url:
            ctx = model_context(url, "oracle", SamplingConfig(max_tokens=512), train=True, tokenizer=tiny_dir)
            (episode,) = run(vf_env, load_tasks(vf_env, env)[0], ctx, 1)
        (sample,), error = training_samples(episode)
        assert error is None and sample.reward == 1.0
        assert (sample.kept_counts is not None) == whole, gaps
        if whole:  # one kept id, the token itself, on every sampled token and on no other
            assert (sample.kept_counts > 0).tolist() == sample.loss_mask
            assert sample.kept_ids.tolist() == [t for t, m in zip(sample.token_ids, sample.loss_mask) if m]


def test_an_exception_in_a_reward_is_an_error_not_a_crash(toy_on_path, tiny_dir):
    env = EnvConfig(id="toy_taskset", args='{"fail_in_reward": true}')
    vf_env = load_env(env)
    task = load_tasks(vf_env, env)[0]
    with serve(oracle_app(sft_conversations(env))) as url:
        episodes = run(vf_env, task, model_context(url, "oracle", SamplingConfig()), 2)
    assert all("toy reward exploded" in episode_error(e) for e in episodes)
    assert training_samples(episodes[0]) == ([], episode_error(episodes[0]))


def test_a_failing_server_is_an_error_not_a_crash():
    env = EnvConfig(id="reverse_text", args=SYNTHETIC, num_examples=1)
    vf_env = load_env(env)
    with serve(oracle_app([], broken=True)) as url:
        episodes = run(vf_env, load_tasks(vf_env, env)[0], model_context(url, "oracle", SamplingConfig()), 2)
    assert all("500" in episode_error(e) for e in episodes)


@contextlib.contextmanager
def dropping_first_reuse(url: str):
    """A TCP proxy in front of `url` that closes, once, a kept-alive connection as its next request arrives:
    what a server does when its keep-alive timeout ends just as the client reuses the connection.
    Yields (the proxy's /v1 URL, a list that gets one entry when the drop happened)."""
    upstream = ("127.0.0.1", int(url.rsplit(":", 1)[1].split("/")[0]))
    listener = socket.create_server(("127.0.0.1", 0))
    dropped: list[int] = []

    def pipe(client: socket.socket) -> None:
        answered = False
        with client, socket.create_connection(upstream) as server:
            while True:
                ready, _, _ = select.select([client, server], [], [])
                if client in ready:
                    data = client.recv(65536)
                    if not data or (answered and not dropped):
                        if data:
                            dropped.append(1)
                        return
                    server.sendall(data)
                if server in ready:
                    data = server.recv(65536)
                    if not data:
                        return
                    answered = True
                    client.sendall(data)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                threading.Thread(target=pipe, args=(listener.accept()[0],), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1", dropped
    finally:
        listener.close()


@pytest.mark.parametrize("env_id,args", [("reverse_text", SYNTHETIC), ("alphabet_sort", THREE_TURNS)])
@pytest.mark.parametrize("train", [False, True])
def test_a_request_the_server_drops_on_a_reused_connection_reruns_the_rollout(env_id, args, train, tiny_dir):
    # A dropped connection is a connection error, retried, not a timeout: as "Request timed out." it once
    # failed every rollout of a group in CI. Episodes are retried whole, single- and multi-turn alike
    # (verifiers' agent does not retry a multi-turn exchange).
    from transformers import AutoTokenizer

    env = EnvConfig(id=env_id, args=args, num_examples=1)
    vf_env = load_env(env)
    task = load_tasks(vf_env, env)[0]
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)

    async def two_groups(ctx):  # the second group reuses the first one's connections
        async with serving(vf_env):
            return [*await run_group(vf_env, task, ctx, 2), *await run_group(vf_env, task, ctx, 2)]

    with (
        serve(oracle_app(sft_conversations(env), tokenizer)) as url,
        dropping_first_reuse(url) as (proxy, dropped),
    ):
        ctx = model_context(proxy, "oracle", SamplingConfig(max_tokens=512), train=train, tokenizer=tiny_dir)
        episodes = asyncio.run(two_groups(ctx))
    assert dropped == [1]
    assert [episode_error(e) for e in episodes] == [None] * 4
    assert [episode_reward(e) for e in episodes] == [1.0] * 4


def test_leaving_serving_closes_the_harness_http_session():
    import plainrl_chat

    env = EnvConfig(id="reverse_text", args=SYNTHETIC, num_examples=1)
    vf_env = load_env(env)

    async def go(ctx):
        async with serving(vf_env):
            (episode,) = await run_group(vf_env, load_tasks(vf_env, env)[0], ctx, 1)
            session = plainrl_chat._sessions[asyncio.get_running_loop()]
            assert not session.closed
        return episode, session

    with serve(oracle_app(sft_conversations(env))) as url:
        episode, session = asyncio.run(go(model_context(url, "oracle", SamplingConfig(max_tokens=512))))
    assert episode_reward(episode) == 1.0
    assert session.closed and session not in plainrl_chat._sessions.values()


def test_cached_default_factory_check_answers_as_pydantic_does():
    import pydantic
    from pydantic._internal import _fields

    load_env(EnvConfig(id="reverse_text", args=SYNTHETIC, num_examples=1))  # installs the cache
    check = _fields.takes_validated_data_argument
    assert hasattr(check, "cached")
    assert check(list) is False and check(lambda data: data["x"]) is True and check(list) is False
    assert check.cached.cache_info().hits >= 1

    class Model(pydantic.BaseModel):
        x: int = 1
        y: int = pydantic.Field(default_factory=lambda data: data["x"] + 1)
        z: list = pydantic.Field(default_factory=list)

    assert Model(x=4).y == 5 and Model.model_construct(x=2).y == 3 and Model.model_construct().z == []
