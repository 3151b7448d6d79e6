"""The builtin engine's linear layers on a CPU: weights laid out once for oneDNN's matmul (float32, and bf16
where the CPU can)."""

import functools

import torch

# The rows oneDNN lays the weights out for: a full decode step's batch (the engine's max_batch_size default).
ROWS = 64
# Why a bf16 model's linear layers stay plain matmuls on a CPU, as the engine's log says it.
PLAIN_REASON = (
    "oneDNN lays bf16 weights out only with AVX-512 BW, VL and DQ or AVX-NE-CONVERT, which this CPU lacks "
    "or ONEDNN_MAX_CPU_ISA keeps it from using"
)


@functools.cache
def cpu_packs_bf16() -> bool:
    """Whether oneDNN lays bf16 weights out on this CPU. An AVX2-only CPU refuses (mkldnn_reorder_linear_weight:
    "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"), and so does one
    whose oneDNN ONEDNN_MAX_CPU_ISA caps below AVX-512: asked once, by laying out a 1 x 1 weight."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(1, 1, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


def bf16_on_cpu(model) -> bool:
    weight = next(model.parameters())
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16


def prepacks(model) -> bool:
    """Whether the engine computes `model`'s linear layers with prepacked weights: float32 on a CPU with oneDNN,
    and bf16 on a CPU whose oneDNN lays bf16 weights out (cpu_packs_bf16); elsewhere plain matmuls. In bf16
    the outputs are the plain matmuls' bit for bit; in float32 they differ by the order of the sums (~1e-7
    relative). A float32 SmolLM2 decode step of 32 rows took 1.4x less time prepacked, its output layer
    2-2.5x less, AVX2 and AVX-512 alike (docs/benchmarks.md)."""
    weight = next(model.parameters())
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and cpu_packs_bf16())


def prepack(model) -> None:
    """Gives every nn.Linear of `model` a copy of its weight in oneDNN's blocked layout and a forward that
    multiplies by it. A plain bf16 matmul lays the weight out again at every call: prepacked, a 64-row
    SmolLM2 decode step's linear layers took 16% less time (their weights read cold, one thread), with
    bit-identical outputs (tests/test_engine.py); float32 ones go through MKL, slower at a decode step's few
    rows (prepacks). Call again whenever the weights change: the copies do not
    follow them. The parameters stay what reloads, adapters and the weight fingerprint read and write."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), ROWS)
            module.forward = functools.partial(packed_forward, module)


def packed_forward(module: torch.nn.Linear, inputs: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(inputs, module.packed, module.bias, "none", [], "")
