"""plainrl_alphabet_sort (id alphabet_sort): sort "FirstLast" names by FIRST or LAST name over several turns, each turn adding names."""

import random
import re
from difflib import SequenceMatcher
from typing import Literal

import verifiers.v1 as vf
from pydantic import model_validator

from lib.config import UserError
from lib.orchestrator.tasks import hf_rows

NUM_SYNTHETIC = 1000
MAX_SYNTHETIC_NAMES = 300  # max_turns x max_names_per_turn; faker has ~700 distinct first names
NEW = " // new name!"


def split_name(name: str) -> tuple[str, str]:
    """Splits "VladimirDrinfeld" into ("Vladimir", "Drinfeld") at the first capital after the first letter."""
    cut = next((i for i in range(1, len(name)) if name[i].isupper()), len(name))
    return name[:cut], name[cut:]


def ground_truths(turns: list[list[str]], by_first: bool) -> list[list[str]]:
    """The expected list after each turn: all names so far, sorted, the ones new in that turn marked (turn 2 on)."""
    expected, seen = [], []
    for index, names in enumerate(turns):
        seen += names
        ranked = sorted(seen, key=lambda name: split_name(name)[0 if by_first else 1])
        expected.append([f"{n}{NEW}" if index > 0 and n in names else n for n in ranked])
    return expected


def turn_tag(index: int) -> str:
    return "alphabetical_sorted" if index == 0 else "combined_alphabetical_sorted"


def turn_similarity(reply: str, expected: list[str], tag: str) -> float:
    """How close one reply is to one turn's expected list, as in the public environment.

    Each <tag>...</tag> block is an attempt, scored by the difflib ratio of its stripped, lowercased,
    non-empty lines against the expected lines (lowercased). Several attempts count only if each beats
    the one before (then the last counts), else the turn scores 0; no block, or an empty one, is 0.
    """
    target = "\n".join(line.strip().lower() for line in expected)
    attempts = []
    for content in re.findall(f"<{tag}>(.*?)</{tag}>", reply, re.DOTALL):
        lines = "\n".join(line.strip().lower() for line in content.split("\n") if line.strip())
        attempts.append(SequenceMatcher(None, lines, target).ratio() if lines and target else 0.0)
    if not attempts:
        return 0.0
    # Retrying inside one reply is allowed only when every attempt beats the previous one.
    improving = all(later > earlier for earlier, later in zip(attempts, attempts[1:]))
    return attempts[-1] if improving else 0.0


def score(
    replies: list[str], expected: list[list[str]], similarity_power: float, power_per_turn: bool
) -> float:
    """Episode reward from the assistant replies, in order; a turn without a reply scores 0.

    The mean over turns of sim^P (power_per_turn), else (mean sim)^P, with P = similarity_power. Turn 1
    answers in <alphabetical_sorted>, later turns in <combined_alphabetical_sorted>.
    """
    sims = [
        turn_similarity(replies[index], truth, turn_tag(index)) if index < len(replies) else 0.0
        for index, truth in enumerate(expected)
    ]
    if power_per_turn:
        return sum(sim**similarity_power for sim in sims) / len(sims)
    return (sum(sims) / len(sims)) ** similarity_power


def reference_replies(expected: list[list[str]]) -> list[str]:
    """The ideal assistant reply of every turn (the SFT targets and the answers of a perfect model)."""
    return [
        f"<{turn_tag(i)}>\n" + "\n".join(names) + f"\n</{turn_tag(i)}>" for i, names in enumerate(expected)
    ]


def reference_conversation(data) -> list[dict]:
    """The episode's user turns, each answered ideally."""
    messages = []
    for user, reply in zip(data.user_turns, reference_replies(data.expected)):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return messages


def user_turns(turns: list[list[str]], by_first: bool, config, rng: random.Random) -> list[str]:
    """The user messages, worded like the public environment (its format templates use NameK placeholders)."""
    label = "FIRST" if by_first else "LAST"
    first = rng.sample(turns[0], len(turns[0]))
    shown = rng.randint(config.min_names_per_turn, config.max_names_per_turn)
    messages = [
        f"Sort these names in alphabetical order by {label} name: {', '.join(first)}\n\n"
        "Use exactly this format:\n<alphabetical_sorted>\n"
        + "\n".join(f"Name{j}" for j in range(1, shown + 1))
        + "\n</alphabetical_sorted>"
    ]
    for index in range(1, len(turns)):
        new = rng.sample(turns[index], len(turns[index]))
        message = (
            f"Now sort ALL of these names alphabetically by {label} name: {', '.join(new)}\n\n"
            "These are in addition to the prior list. Mark any NEW names (that weren't in the prior list) "
            "with `// new name!` at the end."
        )
        if index == 1:
            shown = rng.randint(config.min_names_per_turn, sum(len(names) for names in turns[: index + 1]))
            threshold = rng.randint(0, shown - 1)
            message += (
                "\n\nUse exactly this format:\n<combined_alphabetical_sorted>\n"
                + "\n".join(f"Name{j}" + (NEW if j > threshold else "") for j in range(1, shown + 1))
                + "\n</combined_alphabetical_sorted>"
            )
        else:
            message += " Follow the same format as before."
        messages.append(message)
    return messages


def synthetic_names(num: int, fake) -> list[str]:
    """`num` faker names "FirstLast", no first name and no last name used twice."""
    names, firsts, lasts = [], set(), set()
    while len(names) < num:
        first, last = fake.first_name(), fake.last_name()
        # Multi-part first names would move the first/last cut; skip them rather than mis-sort.
        if first in firsts or last in lasts or not re.fullmatch(r"[A-Z][a-z]+", first) or not last.isalpha():
            continue
        firsts.add(first)
        lasts.add(last)
        names.append(first + last)
    return names


class AlphabetSortConfig(vf.TasksetConfig):
    min_turns: int = 1
    """Fewest turns of an episode."""
    max_turns: int = 3
    """Most turns of an episode (each episode draws its count in min_turns..max_turns)."""
    min_names_per_turn: int = 1
    """Fewest names a turn adds."""
    max_names_per_turn: int = 5
    """Most names a turn adds."""
    similarity_power: float = 4
    """P in the reward: sim^P sharpens the penalty for near misses."""
    power_per_turn: bool = True
    """Mean of per-turn sim^P (true), or (mean sim)^P (false)."""
    source: Literal["auto", "hf", "synthetic"] = "auto"
    """Where the names come from: the HF dataset, faker, or auto (HF when reachable)."""
    dataset: str = "kalomaze/alphabetic-arxiv-authors-it1"
    """HF dataset with a `names` column (lists of "First Last")."""
    split: str = "train"
    """Split of the HF dataset."""
    num_examples: int = -1
    """Episodes to load (-1 = one per usable HF row, or 1000 synthetic ones)."""
    seed: int = 0
    """Seed of the HF row order, the turn splits, FIRST/LAST and the synthetic names."""

    @model_validator(mode="before")
    @classmethod
    def _flatten(cls, values):
        """Upstream's shape keeps the reward settings under "task"; both shapes set the same fields."""
        if isinstance(values, dict) and isinstance(values.get("task"), dict):
            task = dict(values["task"])
            for key in ("similarity_power", "power_per_turn"):
                if key in task:
                    if key in values and values[key] != task[key]:
                        raise UserError(f"{key} is given twice, flat and under task, with different values.")
                    values = {**values, key: task.pop(key)}
            values = {**values, "task": task}
        return values

    @model_validator(mode="after")
    def _check(self):
        if not 1 <= self.min_turns <= self.max_turns:
            raise UserError(f"need 1 <= min_turns <= max_turns, got {self.min_turns} and {self.max_turns}.")
        if not 1 <= self.min_names_per_turn <= self.max_names_per_turn:
            raise UserError(
                "need 1 <= min_names_per_turn <= max_names_per_turn, "
                f"got {self.min_names_per_turn} and {self.max_names_per_turn}."
            )
        if self.similarity_power <= 0:
            raise UserError(f"similarity_power must be positive, got {self.similarity_power}.")
        if self.num_examples == 0 or self.num_examples < -1:
            raise UserError("num_examples must be -1 (all) or positive.")
        return self


class AlphabetSortData(vf.TaskData):
    by_first: bool
    """Sort by first name (true) or by last name."""
    turns: list[list[str]]
    """The names each turn adds, in the order they were drawn."""
    user_turns: list[str]
    """The user message of every turn (the first is also the task prompt)."""
    expected: list[list[str]]
    """The expected list after each turn."""
    similarity_power: float
    """P of the reward."""
    power_per_turn: bool
    """Apply P per turn (true) or to the mean."""


class AlphabetSortTask(vf.Task[AlphabetSortData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def sort_reward(self, task: AlphabetSortData, trace: vf.Trace) -> float:
        replies = [message.content or "" for message in trace.assistant_messages]
        return score(replies, task.expected, task.similarity_power, task.power_per_turn)

    @vf.metric
    async def similarity(self, task: AlphabetSortData, trace: vf.Trace) -> float:
        """Mean per-turn similarity before the power: a gentler view of progress."""
        replies = [message.content or "" for message in trace.assistant_messages]
        return score(replies, task.expected, 1.0, True)


class AlphabetSortEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class AlphabetSortEnv(vf.Env[AlphabetSortEnvConfig]):
    """Plays the user: the first turn is the task prompt, each later one is sent after the model's reply."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            for message in task.data.user_turns[1:]:
                if segment.terminated:
                    break
                segment = await chat.turn(message)


class AlphabetSortTaskset(vf.Taskset[AlphabetSortTask, AlphabetSortConfig]):
    """Episodes from the HF dataset kalomaze/alphabetic-arxiv-authors-it1 (column `names`) when it loads,
    else from faker names; FIRST or LAST, the turn count and the names per turn are drawn per episode.

    Synthetic episodes never repeat a first or a last name, so the expected order has no ties.
    """

    def load(self):
        config = self.config
        rng = random.Random(config.seed)
        rows = hf_rows("alphabet_sort", config.dataset, config.split, config.source)
        if rows is not None:
            rng.shuffle(rows)
            name_lists = ([name.replace(" ", "") for name in row["names"]] for row in rows)
            limit = len(rows) if config.num_examples < 0 else config.num_examples
        else:
            from faker import Faker

            fake = Faker("en_US")
            fake.seed_instance(config.seed)
            longest = config.max_turns * config.max_names_per_turn
            if longest > MAX_SYNTHETIC_NAMES:
                raise UserError(
                    f"synthetic episodes hold at most {MAX_SYNTHETIC_NAMES} names (faker's supply)."
                )
            limit = NUM_SYNTHETIC if config.num_examples < 0 else config.num_examples
            name_lists = (synthetic_names(longest, fake) for _ in range(limit))
        count = 0
        for names in name_lists:
            if count == limit:
                break
            names = list(dict.fromkeys(names))
            sizes = [
                rng.randint(config.min_names_per_turn, config.max_names_per_turn)
                for _ in range(rng.randint(config.min_turns, config.max_turns))
            ]
            if len(names) < sum(sizes):
                continue
            turns, start = [], 0
            for size in sizes:
                turns.append(names[start : start + size])
                start += size
            by_first = rng.choice([True, False])
            messages = user_turns(turns, by_first, config, rng)
            data = AlphabetSortData(
                id=f"alphabet_sort-{count}",
                prompt=messages[0],
                by_first=by_first,
                turns=turns,
                user_turns=messages,
                expected=ground_truths(turns, by_first),
                similarity_power=config.similarity_power,
                power_per_turn=config.power_per_turn,
            )
            yield AlphabetSortTask(data, config.task)
            count += 1


__all__ = [
    "AlphabetSortConfig",
    "AlphabetSortData",
    "AlphabetSortEnv",
    "AlphabetSortEnvConfig",
    "AlphabetSortTask",
    "AlphabetSortTaskset",
]
