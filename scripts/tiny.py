"""Writes the tiny CPU model: a random Qwen3 (hidden 64, 2 layers) with a character-level tokenizer.

The directory is a plain Hugging Face model (config, safetensors, tokenizer, chat template), so
serve.py, vLLM and transformers load it like any other. Same seed, same weights.

Usage:
    python scripts/tiny.py --out outputs/models/tiny
    python scripts/tiny.py --out /tmp/tiny --tiny.hidden-size 128 --tiny.seed 1
"""

import dataclasses
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # finds lib/ outside the virtualenv too
import lib.venv  # noqa: F401  (first: says which python to use when the dependencies are missing)
from lib.config import parse
from lib.models.tiny import TinyConfig


@dataclasses.dataclass
class Config:
    out: Path = Path("outputs/models/tiny")
    """Directory to write the model into (created; existing files are overwritten)."""
    tiny: TinyConfig = dataclasses.field(default_factory=TinyConfig)
    """Model dimensions and seed."""


def main(cfg: Config) -> Path:
    from lib.models.tiny import write_tiny

    print(f"run dir: {cfg.out}")
    start = time.perf_counter()
    out = write_tiny(cfg.out, cfg.tiny)
    print(f"wrote the tiny model in {time.perf_counter() - start:.2f} s")
    print(f"run dir: {out}")
    return out


if __name__ == "__main__":
    main(parse(Config, description=__doc__))
