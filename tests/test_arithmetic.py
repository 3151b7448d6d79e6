"""plainrl_arithmetic: its answer parsing, its reward and metrics on hand-made replies, and its fixed split."""

import asyncio

import plainrl_arithmetic as arith
import pytest

from lib.orchestrator.tasks import EnvConfig, sft_conversations


def test_the_answer_is_the_tagged_integer_else_the_last_one_written():
    assert arith.parse_answer("so <answer> 1,024 </answer> and 7") == 1024
    assert arith.parse_answer("<answer>-3</answer><answer>4</answer>") == -3  # the first block counts
    assert arith.parse_answer("3 + 4 = 7. So 7 it is, not 8") == 8  # no tag: the last integer
    assert arith.parse_answer("<answer>seven</answer> 7") is None  # a block without an integer: no answer
    assert arith.parse_answer("no idea") is None and arith.parse_answer("") is None
    assert arith.last_number("2 - 8 = -6") == -6
    # "1,2" is no way of writing twelve; "12.0" is twelve, tagged or not; "12.5" is no integer
    assert (
        arith.parse_answer("<answer>1,2</answer>") is None
        and arith.parse_answer("<answer>12.0</answer>") == 12
    )
    assert arith.parse_answer("so it is 12.0") == 12 and arith.parse_answer("about 12.5") is None
    assert arith.parse_answer("1,2 or 3") == 3 and arith.parse_answer("<answer>-1,024.00</answer>") == -1024


def rewards(reply: str, expression: str, answer: int) -> dict:
    data = arith.ArithmeticData(id="t", prompt=f"What is {expression}?", expression=expression, answer=answer)
    task = arith.ArithmeticTask(data, arith.ArithmeticConfig().task)

    class Trace:
        last_reply = reply

    trace = Trace()
    return {
        "correct": asyncio.run(task.correct(data, trace)),
        "tagged": asyncio.run(task.tagged(data, trace)),
        "last_number_correct": asyncio.run(task.last_number_correct(data, trace)),
    }


def test_reward_is_one_for_the_exact_value_only_and_metrics_tell_format_from_sum():
    assert rewards("<answer>15</answer>", "8 + 7", 15) == {
        "correct": 1,
        "tagged": 1,
        "last_number_correct": 1,
    }
    assert rewards("8 + 7 = 15", "8 + 7", 15) == {"correct": 1, "tagged": 0, "last_number_correct": 1}
    assert rewards("<answer>15</answer> or 16", "8 + 7", 15) == {
        "correct": 1,
        "tagged": 1,
        "last_number_correct": 0,
    }
    assert rewards("<answer>14</answer>", "8 + 7", 15) == {
        "correct": 0,
        "tagged": 1,
        "last_number_correct": 0,
    }
    assert rewards("<answer>15.0</answer>", "8 + 7", 15)["correct"] == 1  # fifteen, written as a decimal
    assert rewards("<answer>1,5</answer>", "8 + 7", 15)["correct"] == 0


def test_problems_are_seeded_evaluated_as_written_and_split_apart():
    def expressions(split: str, seed: int = 0) -> list:
        env = EnvConfig(
            id="plainrl_arithmetic", args=f'{{"split": "{split}", "seed": {seed}, "max_operand": 20}}'
        )
        conversations = sft_conversations(EnvConfig(id=env.id, args=env.args, num_examples=300))
        return [(c[1]["content"], c[2]["content"]) for c in conversations]

    train, test = expressions("train"), expressions("test")
    assert expressions("train") == train and expressions("train", seed=1) != train
    for prompt, answer in train + test:
        expression = prompt.removeprefix("What is ").removesuffix("?")
        assert answer == f"{expression} = {eval(expression)}\n<answer>{eval(expression)}</answer>"
        # the reference answer (SFT's target) scores 1, tagged, its last number the value
        assert set(rewards(answer, expression, eval(expression)).values()) == {1}
        assert all(1 <= int(n) <= 20 for n in expression.split(" ")[::2])
    assert not {p for p, _ in train} & {p for p, _ in test}  # no test problem is ever a training one
    assert len({p for p, _ in test}) > 100  # and the test split is no handful


def test_a_sum_written_the_other_way_round_is_the_same_problem_and_test_problems_come_once():
    """The split goes by the problem, not its text: "3 + 12" is in the split "12 + 3" is in; and the test
    split gives each problem once, then ends, so an evaluation's count is of distinct problems."""
    assert arith.canonical("12 + 3") == arith.canonical("3 + 12") == "3 + 12"
    assert arith.canonical("12 - 3") == "12 - 3" and arith.canonical("5 * 2 * 3") == "2 * 3 * 5"
    for a in range(1, 30):
        for b in range(1, 30):
            assert arith.in_split(f"{a} + {b}", "test") == arith.in_split(f"{b} + {a}", "test")

    def problems(split: str, max_operand: int, num_examples: int = 2000) -> list[str]:
        args = f'{{"split": "{split}", "max_operand": {max_operand}}}'
        env = EnvConfig(id="plainrl_arithmetic", args=args, num_examples=num_examples)
        return [c[1]["content"].removeprefix("What is ").removesuffix("?") for c in sft_conversations(env)]

    test, train = problems("test", max_operand=8), problems("train", max_operand=8)
    assert not {arith.canonical(p) for p in test} & {arith.canonical(p) for p in train}
    assert len({arith.canonical(p) for p in test}) == len(test)  # each once
    # 8 * 8 differences and 36 sums: the test split holds about a fifth of the 100, and ends there
    assert 8 < len(test) < 40


def test_bad_arguments_fail_in_one_sentence():
    for args in ('{"operations": "/"}', '{"num_operands": 1}', '{"max_operand": 0}'):
        with pytest.raises(ValueError, match=r"operations takes|need max_operand"):
            sft_conversations(EnvConfig(id="plainrl_arithmetic", args=args, num_examples=2))


def test_an_untagged_number_with_commas_is_read_whole_or_not_at_all():
    # Seen: "the sum is 1,2" read as 2 and "12,34" as 34, the digits after the comma taken for the answer.
    assert arith.parse_answer("the sum is 1,2") is None and arith.last_number("12,34") is None
    assert arith.parse_answer("the sum is 1,234") == 1234 and arith.last_number("-12,345,678") == -12345678
    assert arith.parse_answer("3,4 and then 7") == 7  # the last number is well-formed: it is the answer
    assert arith.parse_answer("it is 12.") == 12 and arith.parse_answer("it is 1,234.") == 1234


def old_canonical(expression: str) -> str:
    """The split's key before it took reordered operands of a sum and a difference as one problem."""
    parts = expression.split(" ")
    signs = set(parts[1::2])
    if len(signs) == 1 and signs <= {"+", "*"}:
        return f" {parts[1]} ".join(sorted(parts[::2], key=int))
    return expression


def test_reordered_operands_are_one_problem_and_two_operand_problems_keep_their_side():
    # Seen: "1 + 2 - 3" and "2 + 1 - 3" on opposite sides of the split (1,243 such pairs up to 20).
    import itertools

    assert arith.canonical("2 + 1 - 3") == arith.canonical("1 + 2 - 3")
    assert arith.canonical("3 - 1 + 2") == arith.canonical("2 - 1 + 3") and arith.canonical("5 - 2 - 1") == (
        arith.canonical("5 - 1 - 2")
    )
    sides: dict = {}
    for a, b, c in itertools.product(range(1, 21), repeat=3):
        for first, second in itertools.product("+-", repeat=2):
            text = f"{a} {first} {b} {second} {c}"
            signed = tuple(sorted([a, b if first == "+" else -b, c if second == "+" else -c]))
            sides.setdefault(signed, set()).add(arith.in_split(text, "test"))
            assert arith.canonical(text) == arith.canonical(arith.canonical(text)), text
    assert all(len(side) == 1 for side in sides.values())
    # The demo's held-out set (two operands, up to 30) and its measured results stay as they were: every
    # two-operand problem keeps its key, so its side of the split and its place in the test split's order.
    for a, b in itertools.product(range(1, 100), repeat=2):
        for sign in "+-*":
            assert arith.canonical(f"{a} {sign} {b}") == old_canonical(f"{a} {sign} {b}")
