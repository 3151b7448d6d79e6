"""Tasksets: synthetic data, SFT conversations, the hub fallback, and imports that run one way (tasks before envs)."""

import ast
import time
from pathlib import Path

import pytest

from lib.tasks import EnvConfig, hf_rows, sft_conversations
from lib.tiny import CHARACTERS

ROOT = Path(__file__).resolve().parent.parent
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
    assert "synthetic data" in capsys.readouterr().err


def lib_imports() -> dict[str, set[str]]:
    """Every lib module and the lib modules it imports anywhere: at the top, inside functions, for types."""
    graph = {}
    for path in sorted((ROOT / "lib").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "lib":
                imported |= {f"lib.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lib."):
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names if alias.name.startswith("lib.")}
        graph[name] = imported
    return graph


def test_lib_imports_run_one_way():
    graph = lib_imports()
    assert "lib.envs" not in graph["lib.tasks"] and "lib.data" not in graph["lib.model"]
    done, path = set(), []

    def visit(module: str) -> None:
        assert module not in path, f"import cycle: {' -> '.join([*path[path.index(module) :], module])}"
        if module in done:
            return
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            visit(imported)
        path.pop()
        done.add(module)

    for module in graph:
        visit(module)
