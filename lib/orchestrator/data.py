"""SFT data: conversations from a taskset, a local data file or a Hugging Face dataset, tokenized, in a seeded epoch order."""

import functools
import json
import random
from pathlib import Path
from typing import NamedTuple

from lib.config import UserError


class SftSample(NamedTuple):
    """One tokenized SFT sequence (lib.trainer.packing.sft_rows turns a list of them into rows)."""

    token_ids: list[int]
    loss_mask: list[int]
    """1 on the tokens the model learns to produce (the assistant's), 0 elsewhere."""


# ---------------------------------------------------------------- conversations


def _as_messages(value, role: str) -> list[dict]:
    """A `prompt` / `completion` column: either plain text (one message of `role`) or a list of messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return list(value)


def to_messages(row: dict) -> list[dict]:
    """One record (`messages`, or `prompt` + `completion`) as a list of {role, content} messages."""
    if "messages" in row:
        messages = list(row["messages"])
    elif "prompt" in row and "completion" in row:
        messages = _as_messages(row["prompt"], "user") + _as_messages(row["completion"], "assistant")
    else:
        raise UserError(f"a data record needs `messages` or `prompt` + `completion`, got keys {sorted(row)}.")
    # Datasets add columns such as tool_calls=None that chat templates would render: keep the text, and
    # the tool-call fields only where they are set.
    keep = ("tool_calls", "tool_call_id")
    return [
        {"role": m["role"], "content": m["content"], **{key: m[key] for key in keep if m.get(key)}}
        for m in messages
    ]


def with_tools(row: dict, messages: list[dict]) -> list[dict] | dict:
    """A conversation: its messages, or {"messages", "tools"} when the record offers tools (a `tools` column)."""
    return {"messages": messages, "tools": row["tools"]} if row.get("tools") else messages


def check_data(env) -> None:
    """sft.py's data checked before its run directory: ids as lib.orchestrator.tasks.check_env_ids checks them, and every
    local data file read and its records checked (the read is kept for load_conversations)."""
    from lib.orchestrator.tasks import DATA_FILES, check_env_ids, env_configs

    check_env_ids(env, data=True)
    for config in env_configs(env):
        if config.id.endswith(DATA_FILES):
            check_data_file(config.id)


def check_data_file(source: str) -> list[list[dict] | dict]:
    """The conversations of a local .jsonl (a record a line), .json (a list of records, or a record a line)
    or .parquet file; a missing, unreadable or wrongly keyed file ends in one sentence that names it."""
    path = Path(source).expanduser()
    if not path.is_file():
        raise UserError(f"data file {source} does not exist.")
    return read_data_file(source, path.resolve(), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=2)  # sft.py checks the file before its run directory, then trains on it
def read_data_file(source: str, path: Path, modified_ns: int) -> list[list[dict] | dict]:
    try:
        if source.endswith(".parquet"):
            import pyarrow.parquet

            rows = pyarrow.parquet.read_table(path).to_pylist()
        else:
            text = path.read_text()
            whole = source.endswith(".json") and text.lstrip().startswith("[")
            rows = (
                json.loads(text)
                if whole
                else [json.loads(line) for line in text.splitlines() if line.strip()]
            )
    except (ValueError, OSError) as error:  # json's and pyarrow's errors are ValueErrors
        raise UserError(f"data file {source} could not be read ({error}).") from None
    conversations = []
    for number, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise UserError(f"data file {source}: record {number} is not an object.")
        try:
            conversations.append(with_tools(row, to_messages(row)))
        except (UserError, KeyError, TypeError):
            raise UserError(
                f"data file {source}: record {number} needs `messages` (a list of role/content messages) or "
                f"`prompt` + `completion`, got keys {sorted(row)}."
            ) from None
    return conversations


def load_conversations(env) -> list[list[dict] | dict]:
    """Conversations from `env.id`: a local .jsonl/.json/.parquet file, a Hugging Face dataset id (has a `/`), or a
    taskset id (an environment file too, by any path, when its examples have an `answer`).

    A conversation is its list of messages, or {"messages": [...], "tools": [...]} when it offers tools.
    A mixture (env.mix) gives every environment's conversations, each its own num_examples of them (the
    ratios weigh RL's draws, not these), shuffled together by the batches' per-epoch order.
    """
    if env.mix:
        from lib.orchestrator.mixture import env_configs

        return [conversation for config in env_configs(env) for conversation in load_conversations(config)]
    from lib.orchestrator.tasks import DATA_FILES, is_env_file

    source = env.id
    if source.endswith(DATA_FILES):
        conversations = check_data_file(source)
    elif "/" in source and not is_env_file(source):  # an environment file's path holds `/` too
        import datasets

        try:
            rows = datasets.load_dataset(source, split="train")
        except ConnectionError:  # datasets' answer when the hub is unreachable and nothing is cached
            raise UserError(
                f"could not reach the Hugging Face hub for {source}: give a local .jsonl instead."
            ) from None
        conversations = [with_tools(row, to_messages(row)) for row in rows]
    else:
        from lib.orchestrator.tasks import sft_conversations

        conversations = sft_conversations(env)
    if env.num_examples > 0:
        conversations = conversations[: env.num_examples]
    if not conversations:
        raise UserError(f"data source {source} gave no conversations.")
    return conversations


# ---------------------------------------------------------------- tokenization


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False, tools=None) -> list[int]:
    encoded = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True
    )
    return list(encoded["input_ids"])


def tokenize_conversation(
    tokenizer, messages: list[dict], tools: list[dict] | None = None
) -> list[SftSample]:
    """Token ids plus a mask of the assistant tokens, rendered through the tokenizer's chat template.

    Each assistant turn is located by rendering the conversation up to it with the generation prompt
    (not trained) and then with the turn itself (trained, through the end-of-turn token). When the
    template renders every turn as a growing prefix, the whole conversation is one sample; templates
    that rewrite earlier turns (Qwen3 drops old reasoning) give one sample per assistant turn, each in
    exactly the context the model sees when it produces that turn. Tool results (role "tool") are
    context, as user turns are; `tools` are the tools offered, rendered as the template does.
    """
    turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if not turns:
        raise UserError("a conversation has no assistant message to learn from.")
    spans = []
    for i in turns:
        prompt = render(tokenizer, messages[:i], add_generation_prompt=True, tools=tools)
        full = render(tokenizer, messages[: i + 1], tools=tools)
        if full[: len(prompt)] != prompt:
            raise UserError(
                "the chat template does not render an assistant turn after its generation prompt."
            )
        reply = full[len(prompt) :]
        # Template text after the end-of-turn token (Qwen: a newline) is never generated: no loss on it.
        if tokenizer.eos_token_id in reply:
            end = len(prompt) + len(reply) - reply[::-1].index(tokenizer.eos_token_id)
        else:
            end = len(full)
        spans.append((prompt, full, end))

    whole = spans[-1][1]
    if all(whole[: len(full)] == full for _, full, _ in spans):
        mask = [0] * len(whole)
        for prompt, _, end in spans:
            mask[len(prompt) : end] = [1] * (end - len(prompt))
        return [SftSample(whole, mask)]
    return [
        SftSample(full, [0] * len(prompt) + [1] * (end - len(prompt)) + [0] * (len(full) - end))
        for prompt, full, end in spans
    ]


def tokenize_all(tokenizer, conversations: list, seq_len: int) -> tuple[list[SftSample], int]:
    """Every conversation's samples, cut to seq_len tokens; also returns how many were cut."""
    samples, truncated = [], 0
    for conversation in conversations:
        if isinstance(conversation, dict):
            messages, tools = conversation["messages"], conversation.get("tools")
        else:
            messages, tools = conversation, None
        for ids, mask in tokenize_conversation(tokenizer, messages, tools):
            truncated += len(ids) > seq_len
            samples.append(SftSample(ids[:seq_len], mask[:seq_len]))
    return samples, truncated


# ---------------------------------------------------------------- epoch order


@functools.lru_cache(maxsize=2)
def epoch_order(num_samples: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(num_samples))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)


def batch_indices(step: int, batch_size: int, num_samples: int, seed: int) -> list[int]:
    """The samples of optimizer step `step`: a fixed stream of seeded per-epoch shuffles, so the step
    alone fixes the data position (resume needs nothing else)."""
    indices = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, num_samples)
        indices.append(epoch_order(num_samples, seed, epoch)[offset])
    return indices
