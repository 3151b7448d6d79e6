"""Writes a run's checkpoints/step_N as a Hugging Face directory (LoRA merged), for any step a run kept.

A run keeps its last few weights/step_N (rl.py: keep_weights, 3; sft.py: keep_checkpoints, 2) and its last
checkpoints/step_N (keep_checkpoints, 2), which hold the trained weights in a form only `--resume` reads.
This rebuilds the model as the run did (its config.toml: model.name, lora), loads the checkpoint's
weights into it and writes config, safetensors and tokenizer, as weights/step_N holds them: what
serve.py, eval.py, vLLM and transformers load. LoRA adapters are merged into the weights. The weights
are written in the dtype the run would save on this machine's CPU.

The output directory is replaced whole, so it must be new, empty, or an earlier export holding only what
export.py wrote there (its export.json lists the files); a directory holding anything else, a symbolic link,
a run directory or a folder above one is refused.

Usage:
    python scripts/export.py outputs/tiny/rl/checkpoints/step_100                   # -> outputs/tiny/rl/exported/step_100
    python scripts/export.py outputs/tiny/rl/checkpoints/step_100 --output-dir my_model
"""

import dataclasses
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # finds lib/ outside the virtualenv too
import lib.venv  # noqa: F401  (first: says which python to use when the dependencies are missing)

# isort: split
import tyro

from lib.config import UserError, parse, run_main


@dataclasses.dataclass
class Config:
    checkpoint: tyro.conf.Positional[Path]
    """A run's checkpoints/step_N (the run directory's config.toml says how to build its model)."""
    output_dir: Path | None = None
    """Where the Hugging Face directory goes (default: the run's exported/step_N): a new or empty directory, or an
    earlier export, which it replaces."""


def main(cfg: Config) -> Path:
    """Writes the directory and returns its path."""
    import json
    import tomllib

    import torch

    from lib import dist, rundir
    from lib.models.load import ModelConfig, check_model_name, load_tokenizer
    from lib.provenance import check_base
    from lib.trainer.checkpoint import atomic_dir, damage
    from lib.trainer.servable import lora_scales, merge_lora, write_hf_dir
    from lib.trainer.trainable import LoraConfig, load_trainable

    checkpoint = cfg.checkpoint.expanduser()
    run_dir = checkpoint.parent.parent
    if not (checkpoint / "model.pt").is_file() or checkpoint.parent.name != rundir.CHECKPOINTS:
        raise UserError(f"{checkpoint} is not a run's checkpoints/step_N (it has no model.pt).")
    if problem := damage(checkpoint):
        raise UserError(f"checkpoint {checkpoint} is damaged: {problem}.")
    if not (run_dir / rundir.CONFIG).is_file():
        raise UserError(f"{run_dir} has no {rundir.CONFIG} to rebuild the model from.")
    config = tomllib.loads((run_dir / rundir.CONFIG).read_text())
    model_config = dataclasses.replace(ModelConfig(**config["model"]), device="cpu", compile="off")
    lora = LoraConfig(**config.get("lora", {}))
    check_model_name(model_config.name)  # the run's starting weights, which the checkpoint's are relative to
    if lora.rank:  # the adapters are merged onto the base they trained on, or not at all
        check_base(run_dir, model_config.name, "export")
    output = (cfg.output_dir or run_dir / rundir.EXPORTED / checkpoint.name).expanduser()
    check_output(output, run_dir)

    model, save_dtype, _ = load_trainable(model_config, lora, device="cpu", world_size=1, packing=False)
    trained = torch.load(checkpoint / "model.pt", map_location="cpu")
    missing, unexpected = model.load_state_dict(trained, strict=False)
    expected = {name for name, param in model.named_parameters() if param.requires_grad}
    if unexpected or expected & set(missing):
        raise UserError(
            f"checkpoint {checkpoint} does not fit the model its run's {rundir.CONFIG} describes "
            f"({len(unexpected)} unexpected weights, {len(expected & set(missing))} missing)."
        )
    state = merge_lora(dist.full_model_state(model), lora_scales(model), save_dtype)
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    kind = f"LoRA rank {lora.rank} merged" if lora.rank else "full weights"
    with atomic_dir(output) as tmp:
        write_hf_dir(tmp, state, hf_model, load_tokenizer(model_config.name), save_dtype)
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        record = {"checkpoint": str(checkpoint.resolve()), "weights": kind, "files": files}
        (tmp / rundir.EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        check_output(output, run_dir)  # again, just before the swap: the model took a while to build
    print(
        f"wrote {output} ({kind}, {str(save_dtype).removeprefix('torch.')}): serve.py, eval.py -m, vLLM load it"
    )
    return output


def check_output(output: Path, run_dir: Path) -> None:
    """A one-sentence UserError unless `output` is new, empty or an earlier export that holds only the files its
    export.json lists: atomic_dir replaces it whole. A symbolic link, the run directory, a folder above it and
    any folder holding a run's checkpoints/ are refused whatever else they hold."""
    from lib import rundir

    if output.is_symlink():
        raise UserError(
            f"--output-dir {output} is a symbolic link (to {output.readlink()}), which an export would replace: "
            "give the directory it points to, or a new or empty directory."
        )
    above_run = run_dir.resolve().is_relative_to(output.resolve())
    if above_run or (output / rundir.CHECKPOINTS).is_dir():
        raise UserError(
            f"--output-dir {output} holds a run ({run_dir if above_run else output}), which an export would "
            f"replace: give a new or empty directory (the default is the run's {rundir.EXPORTED}/step_N)."
        )
    if output.exists() and not output.is_dir():
        raise UserError(f"--output-dir {output} is a file: give a new or empty directory.")
    if not output.is_dir():
        return
    record = export_record(output)
    if record is not None and "files" not in record:
        raise UserError(
            f"--output-dir {output} is an export from before {rundir.EXPORT_RECORD} listed the files export.py "
            "wrote, so what else it holds cannot be told apart: move it away yourself, or give a new or empty "
            "directory."
        )
    listed = {rundir.EXPORT_RECORD, *record["files"]} if record else set()
    if extra := foreign(output, listed):
        shown = ", ".join(extra[:3]) + (", ..." if len(extra) > 3 else "")
        raise UserError(
            f"--output-dir {output} holds files export.py did not write ({shown}), which an export would "
            "replace: give a new or empty directory, or an earlier export as export.py left it."
        )


def export_record(directory: Path) -> dict | None:
    """directory's export.json as export.py writes it ({"checkpoint", "weights", "files"}; "files" missing in an
    export from before it was recorded), or None where there is none or someone else's file of that name."""
    import json

    from lib import rundir

    path = directory / rundir.EXPORT_RECORD
    if path.is_symlink() or not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not {"checkpoint", "weights"} <= record.keys():
        return None
    files = record.get("files", [])
    if not isinstance(files, list) or not all(isinstance(name, str) for name in files):
        return None
    return record


def foreign(directory: Path, listed: set[str], prefix: str = "") -> list[str]:
    """What `directory` holds besides the plain files `listed` names (paths relative to it) and the folders
    holding them: each extra entry by its path, a folder by its own name alone."""
    found = []
    for entry in sorted(directory.iterdir()):
        name = prefix + entry.name
        if not entry.is_symlink() and entry.is_dir() and any(f.startswith(f"{name}/") for f in listed):
            found += foreign(entry, listed, f"{name}/")
        elif entry.is_symlink() or not entry.is_file() or name not in listed:
            found.append(name)
    return found


if __name__ == "__main__":
    config = parse(Config, description=__doc__)
    run_main(main, config)
