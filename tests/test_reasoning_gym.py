"""plainrl_reasoning_gym: its reward against reasoning-gym's own scoring on every task, the split, refusals, and
eval.py and rl.py playing it by name."""

import asyncio
import json
import re

import plainrl_reasoning_gym as rg
import pytest
import reasoning_gym
from conftest import ROOT
from oracle import oracle_app, serve
from test_eval import eval_script, evaluate  # noqa: F401  (eval_script: the module's loaded eval.py)
from test_rl import rl, rl_config, server  # noqa: F401  (server: the module's one builtin server)

from lib.config import UserError
from lib.orchestrator.tasks import EnvConfig, check_env_ids, sft_conversations

# Tasks whose entries take a second or more to make: one entry each is enough to compare scores.
SLOW = {"knight_swap"}


def tasks(args: dict, num_examples: int) -> list:
    args = {**args, "num_examples": num_examples}
    return list(rg.ReasoningGymTaskset(rg.ReasoningGymConfig.model_validate(args)))


def reward(task, reply: str) -> float:
    class Trace:
        last_reply = reply

    return asyncio.run(task.correct(task.data, Trace()))


def own_score(dataset, answer, entry) -> float:
    """reasoning-gym's own score; a checker that raises on a malformed answer scores it 0 in plainrl."""
    try:
        return dataset.score_answer(answer, entry)
    except Exception:
        return 0.0


def test_every_task_generates_offline_and_is_scored_by_its_own_checker():
    """On every task reasoning-gym registers: plainrl's reward for a reply is what reasoning-gym's own
    score_answer (a dataset made afresh) gives the text of its <answer> block (None without one) against the
    entry the question came from, for the reference answer (which scores 1), a wrong one, an untagged one."""
    names = rg.task_names()
    assert len(names) >= 100 and "spell_backward" in names and "composite" not in names
    for name in names:
        for task in tasks({"task": name, "seed": 3}, 1 if name in SLOW else 2):
            data, entry = task.data, task.entry
            dataset = reasoning_gym.create_dataset(name, seed=data.seed, size=rg.CHUNK)
            assert (data.prompt, data.task) == (entry["question"], name)
            if name not in rg.NOT_REPRODUCIBLE:  # the same entry again from its seed and index
                assert dataset[data.index]["question"] == entry["question"], name
            replies = ["<answer>certainly not this</answer>", "no tags at all", ""]
            if isinstance(entry["answer"], str):
                replies += [
                    f"<answer>{entry['answer']}</answer>",
                    f"So:\n<answer> {entry['answer']} </answer>",
                ]
                assert reward(task, replies[-1]) == 1.0, name
                replies.append(entry["answer"])  # right, but untagged
            for reply in replies:
                answer = reasoning_gym.utils.extract_answer(reply)
                assert reward(task, reply) == own_score(dataset, answer, entry), (name, reply)


def test_a_wrong_answer_can_score_and_a_checker_that_raises_scores_zero():
    # Checkers of their own: spell_backward's gives partial credit, prime_factorization's raises on text
    # that is no product of integers (reasoning-gym 0.1.25); the reward follows the first, and is 0 for the second.
    (spelled,) = tasks({"task": "spell_backward"}, 1)
    assert 0 < reward(spelled, f"<answer>#{spelled.data.answer[1:]}</answer>") < 1
    (factored,) = tasks({"task": "prime_factorization"}, 1)
    with pytest.raises(ValueError):
        reasoning_gym.create_dataset("prime_factorization", seed=factored.data.seed).score_answer(
            "two", factored.entry
        )
    assert reward(factored, "<answer>two</answer>") == 0.0
    assert reward(factored, f"<answer>{factored.data.answer}</answer>") == 1.0


def test_a_mix_draws_by_weight_and_scores_each_entry_by_its_own_task():
    mix = {"tasks": [{"name": "chain_sum", "weight": 3}, "spell_backward"], "seed": 1}
    drawn = tasks(mix, 200)
    counts = {name: sum(t.data.task == name for t in drawn) for name in ("chain_sum", "spell_backward")}
    assert sum(counts.values()) == 200 and 120 < counts["chain_sum"] < 180  # 3 : 1, 150 expected
    for task in drawn[:20]:
        assert reward(task, f"<answer>{task.data.answer}</answer>") == 1.0
        assert reward(task, "<answer>zzz</answer>") == 0.0


def test_train_and_test_are_disjoint_by_question_text_and_drawn_from_other_seeds():
    # A task with few distinct questions (sums and differences of two digits: ~200 ways of writing them), so
    # that the seeds alone would repeat test questions in train.
    small = {
        "task": "chain_sum",
        "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    }
    train, test = tasks({**small, "split": "train"}, 2000), tasks({**small, "split": "test"}, 2000)
    norm = {t.data.prompt: rg.normalised(t.data.prompt) for t in train + test}
    assert not {norm[t.data.prompt] for t in train} & {norm[t.data.prompt] for t in test}
    assert not {t.data.seed for t in train} & {t.data.seed for t in test}
    # the test split gives each question once and ends when there are no new ones: about a fifth of them
    assert len({norm[t.data.prompt] for t in test}) == len(test) and 15 < len(test) < 80
    assert len(train) == 2000  # train repeats its questions: endless
    # the side of the split goes by the normalised question: case and spacing never move one across
    question = test[0].data.prompt
    assert rg.in_split(question.upper(), "test") and rg.in_split("  " + question.replace(" ", "\n "), "test")
    # seeded: the same draws again; another seed, others
    assert [t.data.prompt for t in tasks({**small, "split": "test"}, 5)] == [t.data.prompt for t in test[:5]]
    other = tasks({"task": "spell_backward", "seed": 1}, 5)
    assert [t.data.prompt for t in other] != [t.data.prompt for t in tasks({"task": "spell_backward"}, 5)]


@pytest.mark.parametrize(
    "args,message",
    [
        ({"task": "spell_backwards"}, r"no task 'spell_backwards' \(did you mean spell_backward\?\)"),
        ({"task": "qqqqzzzz"}, r"no task 'qqqqzzzz' \(none is close\); docs/environments.md lists its 105\."),
        (
            {"task": "spell_backward", "config": {"max_wordlen": 4}},
            r"spell_backward takes no config key 'max_wordlen' \(did you mean max_word_len",
        ),
        ({"task": "spell_backward", "config": {"seed": 4}}, r"seed is set by the split"),
        ({"tasks": [{"name": "gcd", "wieght": 2}]}, r'each entry of "tasks" is a name or'),
        ({"tasks": [{"name": "chain_sums"}]}, r"did you mean chain_sum"),
        (
            {"task": "spell_backward", "config": {"min_word_len": -3}},
            r"refused the spell_backward's config: min_w",
        ),
        ({}, r'takes either "task": NAME or "tasks"'),
        ({"task": "composite"}, r'composite is played with "tasks"'),
    ],
)
def test_an_unknown_task_or_config_key_is_refused_in_one_sentence_naming_close_ones(args, message):
    env = EnvConfig(id="plainrl_reasoning_gym", args=json.dumps(args), num_examples=2)
    with pytest.raises(UserError, match=message) as error:
        sft_conversations(env)
    assert str(error.value).startswith("bad arguments for environment plainrl_reasoning_gym: args: ")
    assert "\n" not in str(error.value)


def test_the_library_itself_as_an_environment_id_points_to_the_taskset():
    with pytest.raises(
        UserError, match=r"reasoning-gym library, not a taskset: --env.id plainrl_reasoning_gym"
    ):
        check_env_ids(EnvConfig(id="reasoning-gym"))
    check_env_ids(EnvConfig(id="plainrl_reasoning_gym"))
    with pytest.raises(UserError, match=r"did you mean plainrl_reasoning_gym"):
        check_env_ids(EnvConfig(id="plainrl_reasoning_gymm"))


def test_sft_data_are_the_tasks_own_answers_in_tags_and_a_task_without_them_is_refused():
    env = EnvConfig(id="plainrl_reasoning_gym", args='{"task": "spell_backward"}', num_examples=3)
    for system, user, assistant in sft_conversations(env):
        assert system["content"] == rg.SYSTEM_PROMPT and user["content"].startswith(
            "Spell this word backward"
        )
        word = user["content"].rsplit(" ", 1)[-1]
        assert assistant == {"role": "assistant", "content": f"<answer>{word[::-1]}</answer>"}
    env = EnvConfig(id="plainrl_reasoning_gym", args='{"task": "rush_hour"}', num_examples=2)
    with pytest.raises(UserError, match=r"rush_hour gives no reference answers"):
        sft_conversations(env)


def test_eval_by_name_scores_the_tasks_answers_one_and_counts_the_test_splits_distinct_questions(
    eval_script,  # noqa: F811
    tmp_path,
    capsys,
):
    args = {"task": "chain_sum", "split": "test", "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}
    env = EnvConfig(id="plainrl_reasoning_gym", args=json.dumps(args), num_examples=500)
    conversations = sft_conversations(env)
    distinct = len(conversations)
    assert distinct < 100  # the split ran out of new questions before 500
    with serve(oracle_app(conversations)) as url:
        argv = f"plainrl_reasoning_gym -m oracle -b {url} -n 500 -r 1 --max-tokens 16".split()
        summary, records, _ = evaluate(eval_script, [*argv, "--env-args", json.dumps(args)], tmp_path, capsys)
    assert summary["avg_reward"] == 1.0 and summary["num_errors"] == 0
    assert summary["num_examples"] == summary["num_rollouts"] == distinct  # each problem once
    assert all(r["metrics"]["tagged"] == 1.0 for r in records)


@pytest.mark.slow
def test_eval_by_name_on_the_tiny_model(eval_script, tiny_dir, server, tmp_path, capsys):  # noqa: F811
    # Against the module's server (rl.py's below reloads it; --reload-weights puts the tiny model back).
    argv = f"plainrl_reasoning_gym -m {tiny_dir} -b {server.url} --reload-weights -n 2 -r 2 --max-tokens 8".split()
    argv += ["--env-args", '{"task": "spell_backward", "split": "test"}']
    summary, records, _ = evaluate(eval_script, argv, tmp_path, capsys)
    assert summary["num_rollouts"] == 4 and summary["num_errors"] == 0
    for record in records:
        assert record["prompt"][-1]["content"].startswith("Spell this word backward")
        assert record["completion"] and 0.0 <= record["reward"] <= 1.0


@pytest.mark.slow
def test_rl_runs_two_steps_on_a_task_by_name(tiny_dir, server, tmp_path):  # noqa: F811
    env = ("--env.id", "plainrl_reasoning_gym", "--env.args", '{"task": "spell_backward", "split": "train"}')
    cfg = rl_config(tiny_dir, tmp_path / "run", server.url, *env, "--examples-per-step", "2")
    history = rl.main(cfg)["history"]
    assert len(history) == 2
    records = [json.loads(line) for line in (tmp_path / "run/rollouts/step_1.jsonl").read_text().splitlines()]
    assert len(records) == 2 * cfg.rollouts_per_example
    for record in records:
        assert re.search(r"Spell this word backward \(example: sun -> nus\): \w+", record["prompt"])
        assert record["env"] == "plainrl_reasoning_gym" and 0.0 <= record["reward"] <= 1.0


def test_the_docs_list_every_task():
    text = (ROOT / "docs" / "environments.md").read_text()
    listed = re.search(r"<!-- reasoning-gym tasks -->\n(.*?)\n<!-- end -->", text, re.DOTALL).group(1)
    assert re.findall(r"`(\w+)`", listed) == rg.task_names()
