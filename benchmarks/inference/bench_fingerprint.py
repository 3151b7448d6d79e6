"""What the weight fingerprint (lib/inference/weights/fingerprint.py) costs a sync, and how closely the two sides agree.

Per shape, dtype and engine: a model written in that dtype, a server started on it in that dtype, then
three rounds of what lib/inference/weights/sync.py does after a reload: the controller's fingerprint of the directory
(of_directory, the files in the page cache as just written), and the server's (/collective_rpc
weight_fingerprint, given the written one to compare, so the round trip and the comparison count). It
prints the median seconds of each and the largest |served - written| over all weights, relative to the sum
of |entries| (the quantity fingerprint.TOLERANCE bounds), for the sum and for the sum of |entries|.

Usage:
    python benchmarks/inference/bench_fingerprint.py                                   # tiny and 2-layer Qwen, both dtypes and engines
    python benchmarks/inference/bench_fingerprint.py --shapes 0.6B --engines torch     # the controller's side at 0.6B
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/


def write_model(shape: str, dtype: str, out: Path) -> Path:
    if shape == "tiny":
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from lib.models.tiny import write_tiny

        source = write_tiny(out / "tiny-source")
        model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype))
        model.save_pretrained(out / f"tiny-{dtype}")
        AutoTokenizer.from_pretrained(source).save_pretrained(out / f"tiny-{dtype}")
        return out / f"tiny-{dtype}"
    from lib.models.qwen import QwenConfig, write_qwen

    return write_qwen(out / f"qwen-{shape}-{dtype}", QwenConfig(shape=shape, dtype=dtype))


def measure(model: Path, engine: str, dtype: str, rounds: int) -> dict:
    import httpx

    from lib import endpoint
    from lib.inference import launch
    from lib.inference.weights import fingerprint

    extra = ["--model.dtype", dtype, "--max-model-len", "512", "--vllm.cpu-kv-cache-gib", "1"]
    with launch.running_server(
        str(model),
        engine=engine,
        weights_root=model.parent,
        log_path=model.parent / f"{engine}.log",
        extra_args=extra,
    ) as server:
        controller, served_seconds = [], []
        for _ in range(rounds):
            began = time.perf_counter()
            written = fingerprint.of_directory(model)
            controller.append(time.perf_counter() - began)
            body = {"method": "weight_fingerprint", "kwargs": {"written": json.dumps(written)}}
            began = time.perf_counter()
            answer = httpx.post(f"{endpoint.root_url(server.url)}/collective_rpc", json=body, timeout=600)
            served_seconds.append(time.perf_counter() - began)
            assert answer.status_code == 200, answer.text[:500]
        served = answer.json()["results"][0]["weights"]
    worst_sum = max(abs(served[n][0] - w[0]) / w[1] for n, w in written.items())
    worst_abs = max(abs(served[n][1] - w[1]) / w[1] for n, w in written.items())
    return {
        "controller_s": statistics.median(controller),
        "server_s": statistics.median(served_seconds),
        "worst_sum": worst_sum,
        "worst_abs": worst_abs,
        "weights": len(written),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shapes", nargs="+", default=["tiny", "test"], help="tiny, or a lib/models/qwen.py shape"
    )
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--engines", nargs="+", default=["torch", "vllm"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(
        f"{'shape':6} {'dtype':9} {'engine':6} {'weights':>7} {'controller s':>12} {'server s':>9} {'sum diff':>9} {'|x| diff':>9}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            for dtype in args.dtypes:
                model = write_model(shape, dtype, Path(tmp))
                for engine in args.engines:
                    r = measure(model, engine, dtype, args.rounds)
                    print(
                        f"{shape:6} {dtype:9} {engine:6} {r['weights']:7} {r['controller_s']:12.3f} "
                        f"{r['server_s']:9.3f} {r['worst_sum']:9.1e} {r['worst_abs']:9.1e}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
