"""The GPU check: plainrl's SFT and RL at the Qwen3-0.6B shape on one CUDA GPU, in one command, with throughput,
MFU and memory beside prime-rl's published figures.

Made for a bare CUDA machine without network, which has torch and transformers but not the rest (make
gpu-wheels gathers it: benchmarks/gpu/gather_gpu_wheels.py). With --wheels the folder is installed into a
temporary target (pip --no-index --no-deps) and the script runs again with PYTHONPATH=target:repo, so
plainrl runs from the source tree on the machine's own torch (never `pip install .`: pyproject pins torch
2.13). It stops at once, in one sentence, if that torch lacks an API plainrl calls (TORCH_APIS), and
records any requirement the machine's packages do not meet. Then, on a Qwen3 shape with random weights
and Qwen's tokenizer (lib/models/qwen.py, what scripts/qwen.py writes), in this order:

- trainer_sft, trainer_rl: trainer only, fake data, at prime-rl's shapes: one row of 8k tokens with the
  SFT loss, one of 16k with rl.py's policy loss; float32 master weights under bf16 autocast, AdamW, no
  activation checkpointing (prime-rl's 0.6B rows recompute). Tokens/s, peak memory and MFU: torchtitan's
  FLOPs (prime-rl's), 6 x parameters + 12 x layers x heads x head_dim x sequence length per token, over
  the GPU's bf16 dense peak (989 TFLOP/s for an H100 SXM; PEAK_TFLOPS, or --peak-tflops);
- varlen: lib/models/attention.py's packed attention under bf16 autocast takes the variable-length kernel (its
  calls are counted, in the trainer rows too) and matches the per-sample SDPA loop within bf16 tolerance;
- head: the chunked output layer (lib/trainer/head.py) against full logits: extra peak memory of one forward and
  backward at 4k and 16k loss tokens, and the largest logprob difference between the two;
- sft: scripts/sft.py's main() for 20 steps at configs/reverse_text/sft.toml's shape (batch 32, micro 4,
  rows of 4096, packing) on the reverse_text taskset's offline samples: median tokens/s after step 1, MFU;
- fsdp2: lib/dist.py's FSDP2 at world size 1 (NCCL; gloo on CPU): one step, then the full state gathered;
- lora: one step with LoRA rank 16;
- rl: scripts/rl.py's main() for 3 steps on benchmarks/letters.py with the builtin engine on the
  same GPU (colocated), on-policy (the rollout wait is then the sampling time): sampled tokens/s, train
  tokens/s and sync seconds as rl.py logs them, every weight check (the server reports the new weights'
  label) and probe difference (bf16 on GPU), the trainer's and the whole device's peak memory.

Every figure goes to OUT/gpu_check.json and a markdown table, OUT/gpu_check.md (rewritten after each
section, so a run cut short keeps what it measured), and is printed. A section that fails is recorded
under "errors" with its figures null, the others still run, and the exit status is 1. With --device cpu
--shape test the same script runs on 2 CPU cores in under a minute, in make test (tests/test_gpu_check.py),
on lib/models/qwen.py's 2-layer test shape narrowed to hidden 64 (PLANS; still Qwen's whole vocabulary and
tokenizer) with small batches: there the CUDA-only figures (CUDA_ONLY) are null. The sections themselves are
in trainer_sections.py (the trainer alone) and run_sections.py (sft.py's and rl.py's main()).

Usage:
    python3 benchmarks/gpu/gpu_check.py --wheels gpu-wheels --out outputs/gpu_check    # the GPU machine
    python3 benchmarks/gpu/gpu_check.py --wheels gpu-wheels --sections rl               # one section again
    python benchmarks/gpu/gpu_check.py --device cpu --shape test                        # CPU, 2-layer shape
"""

import argparse
import atexit
import contextlib
import gc
import importlib
import inspect
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# plainrl from the source tree: lib/ and benchmarks/, and its tasksets and chat harness as the installed package
# maps them (pyproject's package-dir).
SOURCE_PATHS = [
    str(Path(__file__).resolve().parents[2]),
    str(Path(__file__).resolve().parents[2] / "lib" / "orchestrator" / "tasksets"),
]
sys.path[:0] = SOURCE_PATHS
from benchmarks.common import ROOT  # noqa: E402
from benchmarks.gpu.run_sections import section_rl, section_sft  # noqa: E402
from benchmarks.gpu.trainer_sections import (  # noqa: E402
    PLANS,
    Setup,
    section_fsdp2,
    section_head,
    section_lora,
    section_model,
    section_varlen,
    trainer_row,
)

SITE_VARIABLE = "PLAINRL_GPU_CHECK_SITE"  # set in the run on top of the installed wheels
SITE_PREFIX = "plainrl-gpu-check-"  # the folder bootstrap() installs the wheels into, and removes at the end

# fmt: off
# What plainrl calls in torch that releases before the lock's 2.13 may lack: (module, name, keywords, caller).
TORCH_APIS = [
    ("torch.nn.attention.varlen", "varlen_attn", ("scale", "window_size"), "lib/models/attention.py"),
    ("torch.distributed.fsdp", "fully_shard", ("mp_policy",), "lib/dist.py"),
    ("torch.distributed.fsdp", "MixedPrecisionPolicy", ("param_dtype", "reduce_dtype"), "lib/dist.py"),
    ("torch.distributed.checkpoint.state_dict", "StateDictOptions",
     ("full_state_dict", "cpu_offload", "ignore_frozen_params", "broadcast_from_rank0", "strict"), "lib/dist.py"),
    ("torch", "get_autocast_dtype", (), "lib/trainer/head.py, lib/models/attention.py"),
]
# bf16 dense peak TFLOP/s by device name, first match (torchtitan's and prime-rl's table).
PEAK_TFLOPS = [("H100 NVL", 835), ("H100 PCIe", 756), ("H100", 989), ("H200", 989), ("H800", 989), ("A100", 312)]
# prime-rl BENCHMARKS.md, Qwen3-0.6B, trainer only, fake data, one H100: (tokens/s, MFU).
PRIME_RL = {"trainer_sft": (26_000, 0.168), "trainer_rl": (11_900, 0.111)}

# Every figure the check writes, by section (the JSON's keys), and those only a CUDA run measures (null on CPU).
FIGURES = {
    "run": ("device", "device_name", "shape", "python", "packages", "requirement_problems", "peak_bf16_tflops",
            "seconds"),
    "model": ("parameters", "layers", "write_seconds"),
    "trainer_sft": ("tokens", "step_seconds", "tokens_per_second", "mfu", "peak_memory_gib"),
    "trainer_rl": ("tokens", "step_seconds", "tokens_per_second", "mfu", "peak_memory_gib"),
    "varlen": ("kernel", "calls_in_training", "max_abs_difference", "within_bf16_tolerance", "varlen_ms",
               "sdpa_loop_ms"),
    "head": ("tokens", "logp_max_difference", "chunked_peak_gib", "full_peak_gib"),
    "sft": ("steps", "tokens_per_second", "mfu", "peak_memory_gib", "final_loss"),
    "fsdp2": ("backend", "sharded_parameters", "loss", "step_seconds", "full_state_tensors", "peak_memory_gib"),
    "lora": ("rank", "trained_parameters", "loss", "step_seconds", "tokens_per_second", "peak_memory_gib"),
    "rl": ("steps", "rollout_tokens_per_second", "train_tokens_per_second", "sync_seconds", "weight_checks",
           "probe_differences", "probe_tolerance", "reward_mean", "trainer_peak_memory_gib", "device_peak_memory_gib"),
}
CUDA_ONLY = {
    "run": ("peak_bf16_tflops",),
    "trainer_sft": ("mfu", "peak_memory_gib"),
    "trainer_rl": ("mfu", "peak_memory_gib"),
    "varlen": ("kernel", "calls_in_training", "max_abs_difference", "within_bf16_tolerance", "varlen_ms"),
    "head": ("chunked_peak_gib", "full_peak_gib"),
    "sft": ("mfu", "peak_memory_gib"),
    "fsdp2": ("peak_memory_gib",),
    "lora": ("peak_memory_gib",),
    "rl": ("trainer_peak_memory_gib", "device_peak_memory_gib"),
}
# fmt: on


# ---------------------------------------------------------------- the machine


def bootstrap(wheels: Path) -> None:
    """Installs the wheel folder into a temporary target and runs this script again on top of it."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        sys.exit(
            f"{wheels} holds no wheels: run `make gpu-wheels` where pip reaches PyPI and bring the folder."
        )
    site = tempfile.mkdtemp(prefix=SITE_PREFIX)
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    subprocess.run([*command, "--disable-pip-version-check", "--target", site, *map(str, found)], check=True)
    path = os.pathsep.join(p for p in (site, *SOURCE_PATHS, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, SITE_VARIABLE: site, "PYTHONPATH": path}
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]], env)


def missing_torch_apis() -> list[str]:
    """The entries of TORCH_APIS this torch lacks, each as `module.name(keyword=) (caller)`."""
    missing = []
    for module_name, name, keywords, caller in TORCH_APIS:
        try:
            api = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):
            missing.append(f"{module_name}.{name} ({caller})")
            continue
        lacking = [k for k in keywords if k not in inspect.signature(api).parameters]
        if lacking:
            missing.append(f"{module_name}.{name}({', '.join(k + '=' for k in lacking)}) ({caller})")
    return missing


def torch_problem() -> str | None:
    """The one sentence to stop with when this torch lacks an API plainrl calls, else None."""
    import torch

    missing = missing_torch_apis()
    if not missing:
        return None
    return (
        f"torch {torch.__version__} lacks what plainrl calls: {'; '.join(missing)} (plainrl's lock pins torch "
        "2.13.0): nothing was measured."
    )


def requirement_problems() -> list[str]:
    """plainrl's requirements (torch's and numpy's relaxed, as for the wheels) and the carried wheels'
    that the packages found here do not meet: the machine's versions nobody had read are checked here."""
    from importlib import metadata

    from packaging.requirements import Requirement

    from benchmarks.gpu.gather_gpu_wheels import plainrl_requirements

    requirements = [(r, "plainrl") for r in plainrl_requirements()]
    if os.environ.get(SITE_VARIABLE):
        for dist in metadata.distributions(path=[os.environ[SITE_VARIABLE]]):
            requirements += [(Requirement(line), dist.metadata["Name"]) for line in dist.requires or []]
    problems = set()
    for requirement, by in requirements:
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue
        try:
            version = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            problems.add(f"{by} needs {requirement}, which is missing")
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            problems.add(f"{by} needs {requirement}, found {version}")
    return sorted(problems)


def run_figures(setup: Setup) -> dict:
    from importlib import metadata

    import torch

    names = ["torch", "transformers", "peft", "numpy", "tokenizers", "safetensors", "huggingface-hub"]
    names += ["accelerate", "verifiers", "datasets", "fsspec", "pyarrow", "tensorboard", "aiohttp", "httpx"]
    packages = {}
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            packages[name] = metadata.version(name)
    return {
        "device": setup.device,
        "device_name": torch.cuda.get_device_name() if setup.cuda else platform.processor() or "cpu",
        "shape": setup.shape,
        "python": platform.python_version(),
        "packages": packages,
        "requirement_problems": requirement_problems(),
        "peak_bf16_tflops": setup.peak_tflops,
    }


SECTIONS = {
    "trainer_sft": lambda setup: trainer_row(setup, "sft"),
    "trainer_rl": lambda setup: trainer_row(setup, "rl"),
    "varlen": section_varlen,
    "head": section_head,
    "sft": section_sft,
    "fsdp2": section_fsdp2,
    "lora": section_lora,
    "rl": section_rl,
}


# ---------------------------------------------------------------- output


def check_figures(results: dict) -> None:
    for section, figures in FIGURES.items():
        assert set(results[section]) == set(figures), f"{section}: {sorted(results[section])} != FIGURES"


def show(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(show(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items())
    return str(value)


def markdown(results: dict) -> str:
    lines = ["| section | figure | this run | prime-rl, one H100 |", "| --- | --- | --- | --- |"]
    for section in (s for s in FIGURES if s in results):
        for figure, value in results[section].items():
            if figure == "mfu" and value is not None:
                shown = f"{value:.1%}"
            else:
                shown = show(value)
            reference = ""
            if section in PRIME_RL and figure in ("tokens_per_second", "mfu"):
                speed, utilisation = PRIME_RL[section]
                reference = f"{speed / 1000:.1f}k" if figure == "tokens_per_second" else f"{utilisation:.1%}"
            lines.append(f"| {section} | {figure} | {shown} | {reference} |")
    for section, error in results["errors"].items():
        lines.append(f"| {section} | error | {error} | |")
    return "\n".join(lines) + "\n"


def write(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "gpu_check.md").write_text(markdown(results))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shape", default="0.6B", choices=sorted(PLANS))
    parser.add_argument("--wheels", type=Path, help="wheel folder to install first (make gpu-wheels)")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "outputs" / "gpu_check", help="where the JSON and table go"
    )
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--peak-tflops", type=float, help="the GPU's bf16 dense peak (default: by its name)")
    args = parser.parse_args()
    if args.wheels and SITE_VARIABLE not in os.environ:
        bootstrap(args.wheels)
    site = os.environ.get(SITE_VARIABLE)
    if site and Path(site).name.startswith(SITE_PREFIX):  # the folder bootstrap() made, no one else's
        atexit.register(shutil.rmtree, site, ignore_errors=True)
    began = time.perf_counter()
    os.environ.setdefault(
        "HF_HUB_OFFLINE", "1"
    )  # local directories only: no hub look-ups on a machine without network
    # serve.py, which rl.py starts, finds lib (and the carried wheels) the same way.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (*SOURCE_PATHS, os.environ.get("PYTHONPATH")) if p)

    import torch

    problem = torch_problem()
    if problem:
        sys.exit(problem)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device is visible: on a machine without one, run with --device cpu --shape test.")
    peak = args.peak_tflops
    if args.device == "cuda" and peak is None:
        name = torch.cuda.get_device_name()
        peak = next((tflops for key, tflops in PEAK_TFLOPS if key in name), None)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        setup = Setup(device=args.device, shape=args.shape, work=Path(work), peak_tflops=peak)
        results = {"run": run_figures(setup), "model": section_model(setup), "errors": {}}
        print(f"{results['run']['device_name']}, Qwen3 {args.shape} shape: {json.dumps(results['model'])}")
        for problem in results["run"]["requirement_problems"]:
            print(f"WARNING: {problem}")
        for name, section in SECTIONS.items():
            values, section_began = {}, time.perf_counter()
            if name in args.sections:
                print(f"--- {name}", flush=True)
                try:
                    values = section(setup)
                except Exception as error:  # recorded: one failing section leaves the others' figures
                    traceback.print_exc()
                    results["errors"][name] = (
                        f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
                    )
                gc.collect()
                if setup.cuda:
                    torch.cuda.empty_cache()
            assert set(values) <= set(FIGURES[name]), (
                f"{name} wrote figures FIGURES does not list: {set(values)}"
            )
            results[name] = {figure: values.get(figure) for figure in FIGURES[name]}
            print(
                f"{name} ({time.perf_counter() - section_began:.1f} s): {json.dumps(results[name])}",
                flush=True,
            )
            results["run"]["seconds"] = time.perf_counter() - began
            write(results, args.out)
    check_figures(results)
    write(results, args.out)
    print(markdown(results))
    print(f"figures: {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'}")
    sys.exit(1 if results["errors"] else 0)


if __name__ == "__main__":
    main()
