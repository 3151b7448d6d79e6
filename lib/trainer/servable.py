"""weights/step_N, what servers and transformers load: a Hugging Face directory or a LoRA adapter alone."""

import copy
from pathlib import Path

from lib import dist, rundir
from lib.trainer.checkpoint import atomic_dir, prune


def lora_scales(model) -> dict[str, float]:
    """alpha / rank of every peft LoRA layer, by module name ({} without LoRA)."""
    return {
        name: module.scaling["default"]
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and "default" in getattr(module, "scaling", {})
    }


def merge_lora(state: dict, scales: dict[str, float], dtype=None) -> dict:
    """A peft state dict turned into the plain model's: W + scale * B @ A, original key names; merged
    weights are cast to `dtype` one by one (a whole float32 copy of the model would double the peak)."""
    if not scales:
        return state
    assert not any("lora_embedding" in key for key in state), "only Linear LoRA layers can be merged"
    merged = {}
    for key, value in state.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        if ".base_layer." in key:
            module, name = key.split(".base_layer.")
            if name == "weight":
                lora_a, lora_b = (
                    state[f"{module}.lora_A.default.weight"],
                    state[f"{module}.lora_B.default.weight"],
                )
                value = value + (scales[module] * (lora_b.float() @ lora_a.float())).to(value.dtype)
                value = value.to(dtype or value.dtype)
            key = f"{module}.{name}"
        merged[key.removeprefix("base_model.model.")] = value
    return merged


def write_hf_dir(path: Path, state: dict, hf_model, tokenizer, dtype) -> None:
    """config.json, model.safetensors, generation config and tokenizer: what transformers and vLLM load."""
    from safetensors.torch import save_file

    config = copy.deepcopy(hf_model.config)
    config.dtype = dtype
    config.use_cache = True
    config.save_pretrained(path)
    if hf_model.generation_config is not None:
        hf_model.generation_config.save_pretrained(path)
    tensors = {key: value.to(dtype).contiguous() for key, value in state.items()}
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)  # the same tensor as the embeddings; safetensors stores it once
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(path)


def write_adapter_dir(path: Path, model, state: dict, dtype) -> None:
    """adapter_config.json and adapter_model.safetensors, PEFT's layout (what vLLM's /v1/load_lora_adapter
    and peft.PeftModel.from_pretrained read): the in-memory keys' adapter name (.default) is dropped."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    model.peft_config["default"].save_pretrained(path)
    tensors = get_peft_model_state_dict(model, state_dict=state, save_embedding_layers=False)
    tensors = {key: value.to(dtype).contiguous() for key, value in tensors.items()}
    save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})


def save_weights(
    run_dir: Path, step: int, model, tokenizer, dtype, keep: int, adapter: bool = False, merged: bool = False
) -> Path:
    """weights/step_N in `dtype`: the full model (LoRA merged) as a Hugging Face directory; with `adapter`,
    the LoRA adapter alone (a few MB, write_adapter_dir), and where `merged` the full model in step_N/merged
    as well (what eval.py, serve.py and transformers load)."""
    whole = not adapter or merged
    state = dist.full_model_state(model, trainable_only=not whole)
    path = Path(run_dir) / rundir.WEIGHTS / f"step_{step}"
    if dist.world()[0] == 0:
        hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
        with atomic_dir(path) as tmp:
            if adapter:
                write_adapter_dir(tmp, model, state, dtype)
            if whole:
                full = merge_lora(state, lora_scales(model), dtype)
                write_hf_dir(tmp / "merged" if adapter else tmp, full, hf_model, tokenizer, dtype)
        prune(path.parent, keep, written=step)
    dist.barrier()
    return path


def servable(weights: Path) -> Path:
    """The directory of weights/step_N that serve.py, eval.py and transformers load: step_N/merged for a
    run that synced LoRA adapters, step_N itself otherwise."""
    return weights / "merged" if (weights / "merged").is_dir() else weights
