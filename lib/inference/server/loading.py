"""The builtin engine's weights from disk, checked against the served model: a safetensors directory, or a
LoRA adapter as what it adds to the model's weights."""

from pathlib import Path

import torch

from lib.config import UserError


def read_weights(model, directory: Path) -> dict[str, torch.Tensor]:
    """Reads a Hugging Face safetensors directory and checks it holds exactly this model's tensors."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise UserError(f"{directory} holds no .safetensors files.")
    tensors = {}
    for file in files:
        tensors.update(load_file(file))
    check_tensors(model, tensors, str(directory))
    return tensors


def check_tensors(model, tensors: dict[str, torch.Tensor], source: str) -> None:
    """A UserError unless `tensors` are exactly this model's weights, in its shapes."""
    state = model.state_dict()
    required = {name for name, _ in model.named_parameters()}  # a tied weight is listed once
    unknown, missing = sorted(set(tensors) - set(state)), sorted(required - set(tensors))
    if unknown or missing:
        raise UserError(
            f"{source} does not fit the served model (missing {missing[:3]}, unknown {unknown[:3]})."
        )
    for name, tensor in tensors.items():
        if tensor.shape != state[name].shape:
            raise UserError(
                f"{source}: {name} has shape {tuple(tensor.shape)}, the model {tuple(state[name].shape)}."
            )


def read_adapter(model, directory: Path, max_rank: int) -> dict[str, torch.Tensor]:
    """A PEFT LoRA directory (adapter_config.json, adapter_model.safetensors) as what it adds to the
    model's weights, {weight name: alpha / r x B @ A} in float32, checked against the model."""
    import json

    from safetensors.torch import load_file

    config = json.loads((directory / "adapter_config.json").read_text())
    rank, alpha = config["r"], config["lora_alpha"]
    if rank > max_rank:
        raise UserError(
            f"{directory}: LoRA rank {rank} is more than the server's --max-lora-rank {max_rank}."
        )
    if config.get("use_dora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise UserError(
            f"{directory}: only plain LoRA is served (no DoRA, one rank and alpha for every layer)."
        )
    scale = alpha / (rank**0.5 if config.get("use_rslora") else rank)
    tensors = load_file(directory / "adapter_model.safetensors")
    shapes = {name: param.shape for name, param in model.named_parameters()}
    deltas = {}
    for key, lora_a in tensors.items():
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            lora_b = tensors.get(key.replace(".lora_A.", ".lora_B."))
            name = f"{module}.weight"
            if lora_b is None or shapes.get(name) != (lora_b.shape[0], lora_a.shape[1]):
                raise UserError(f"{directory} does not fit the served model ({module}).")
            deltas[name] = scale * (lora_b.float() @ lora_a.float())
    if not deltas or 2 * len(deltas) != len(tensors):
        raise UserError(f"{directory} holds other tensors than LoRA's A and B of linear layers.")
    return deltas
