"""Writes a run's checkpoints/step_N as a Hugging Face directory (LoRA merged), for any step a run kept.

A run keeps its last few weights/step_N (rl.py: keep_weights, 3; sft.py: keep_checkpoints, 2) and its last
checkpoints/step_N (keep_checkpoints, 2), which hold the trained weights in a form only `--resume` reads.
This rebuilds the model as the run did (its config.toml: model.name, lora), loads the checkpoint's
weights into it and writes config, safetensors and tokenizer, as weights/step_N holds them: what
serve.py, eval.py, vLLM and transformers load. LoRA adapters are merged into the weights. The weights
are written in the dtype the run would save on this machine's CPU.

The output directory is replaced whole, so it must be new, empty, or an earlier export (export.py leaves
export.json in each); a directory holding anything else, a run directory or a folder above one is refused.

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
        record = {"checkpoint": str(checkpoint.resolve()), "weights": kind}
        (tmp / rundir.EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"wrote {output} ({kind}, {str(save_dtype).removeprefix('torch.')}): serve.py, eval.py -m, vLLM load it"
    )
    return output


def check_output(output: Path, run_dir: Path) -> None:
    """A one-sentence UserError unless `output` is new, empty or an earlier export: atomic_dir replaces it whole.
    The run directory, a folder above it and any folder holding a run's checkpoints/ are refused whatever else
    they hold."""
    from lib import rundir

    above_run = run_dir.resolve().is_relative_to(output.resolve())
    if above_run or (output / rundir.CHECKPOINTS).is_dir():
        raise UserError(
            f"--output-dir {output} holds a run ({run_dir if above_run else output}), which an export would "
            f"replace: give a new or empty directory (the default is the run's {rundir.EXPORTED}/step_N)."
        )
    if output.exists() and not output.is_dir():
        raise UserError(f"--output-dir {output} is a file: give a new or empty directory.")
    held = sorted(p.name for p in output.iterdir()) if output.is_dir() else []
    if held and rundir.EXPORT_RECORD not in held:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise UserError(
            f"--output-dir {output} holds files export.py did not write ({shown}), which an export would "
            "replace: give a new or empty directory, or an earlier export."
        )


if __name__ == "__main__":
    config = parse(Config, description=__doc__)
    run_main(main, config)
