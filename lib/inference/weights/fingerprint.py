"""Weight fingerprints: per weight, float64 sums over a few fixed input columns, computed by a server from what
its engine computes with and by the controller from the safetensors it wrote (lib/inference/weights/reload.py compares them)."""

import json
from pathlib import Path

import torch

# Input columns summed per weight matrix: all of them up to COLUMNS, else COLUMNS evenly spread. A training
# step moves entries in every column (in bf16, those it pushes past a rounding boundary), so a few columns
# see it; vLLM's CPU build shows its packed weights one input column at a time (a one-hot input), so every
# column costs it a row of GEMM.
COLUMNS = 64
# Largest |served - written| sum, relative to the sum of |entries| over the same columns. Where the server
# holds the written values exactly (the same dtype, or a wider one), the two sums differ only by float64
# summation order: measured 0 to 3e-16 (benchmarks/inference/bench_fingerprint.py: float32 and bf16, both
# engines, the tiny, 2-layer Qwen3 and 0.6B shapes); one entry of ~0.02 moved by one bf16 step in a 151,936 x 1024
# output layer is 4e-10 to 8e-10.
TOLERANCE = 1e-12


def columns(num_inputs: int) -> torch.Tensor:
    """The input columns a weight with `num_inputs` inputs is fingerprinted by."""
    if num_inputs <= COLUMNS:
        return torch.arange(num_inputs)
    return torch.arange(COLUMNS) * num_inputs // COLUMNS + num_inputs // (2 * COLUMNS)


def of_values(values: torch.Tensor) -> list[float]:
    """[sum, sum of |x|] in float64: the fingerprint of the picked entries of one weight."""
    return [values.sum(dtype=torch.float64).item(), values.abs().sum(dtype=torch.float64).item()]


def of_tensor(tensor: torch.Tensor) -> list[float]:
    """A vector (a norm's weight, a bias) whole; a matrix (outputs, inputs), or a stack of them (a mixture of
    experts' fused weights: experts, outputs, inputs), over its fingerprint columns."""
    if tensor.ndim == 1:
        return of_values(tensor)
    assert tensor.ndim in (2, 3), f"a weight of shape {tuple(tensor.shape)} has no fingerprint"
    return of_values(tensor.index_select(-1, columns(tensor.shape[-1]).to(tensor.device)))


def of_directory(directory: Path, dtype: str | None = None) -> dict[str, list[float]]:
    """{weight name: fingerprint} of a Hugging Face safetensors directory, in the dtype it was written in (or
    rounded to `dtype`, "bfloat16" say, as a server loading it in that dtype rounds it), the output layer
    included where it is the embedding (tie_word_embeddings: the file holds it once)."""
    from safetensors import safe_open

    fingerprints = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(file, framework="pt") as weights:
            for name in weights.keys():
                tensor = weights.get_tensor(name)
                if dtype and tensor.is_floating_point():
                    tensor = tensor.to(getattr(torch, dtype))
                fingerprints[name] = of_tensor(tensor)
    config = json.loads((Path(directory) / "config.json").read_text())
    tied = config.get("tie_word_embeddings") or config.get("text_config", {}).get("tie_word_embeddings")
    if tied and "lm_head.weight" not in fingerprints and "model.embed_tokens.weight" in fingerprints:
        fingerprints["lm_head.weight"] = fingerprints["model.embed_tokens.weight"]
    return fingerprints


def first_difference(written: dict[str, list[float]], served: dict[str, list[float]]) -> str | None:
    """The first weight, in the server's order, whose served fingerprint is not the written one (or that the
    server lacks), in words; None when every written weight is served."""
    names = [name for name in served if name in written] + [name for name in written if name not in served]
    for name in names:
        if name not in served:
            return f"{name} (not served)"
        (served_sum, served_abs), (written_sum, written_abs) = served[name], written[name]
        scale = TOLERANCE * max(written_abs, 1e-30)
        if abs(served_sum - written_sum) > scale or abs(served_abs - written_abs) > scale:
            return f"{name} (sum {served_sum:.12g} served, {written_sum:.12g} written)"
    return None
