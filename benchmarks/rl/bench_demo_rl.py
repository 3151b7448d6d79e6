"""Does RL still teach? `make demo`'s RL stage again from its saved SFT weights, scored on the demo's held-out
problems before and after: the gain with the standard error of its paired differences, as a number to compare
across changes (a change that breaks learning shows as a gain within noise).

It reruns only what RL decides: the SFT weights and the presets (configs/smollm2_two_digit/{rl,eval}.toml)
are the demo's, the RL run goes to --out (started over each time: a new or empty folder, or an earlier output
of this benchmark, recognised by its record bench_demo_rl.json and by holding nothing else), and the score before RL is taken again,
with the same held-out problems, so that both sides of the gain come from this run. Sampled at the RL
temperature (the demo's figure) and greedily. ~14 minutes on 2 quiet cores at the preset's 60 steps
(12 of them RL: docs/smollm2.md).

Usage:
    make demo                                     # once: the SFT weights this starts from
    python benchmarks/rl/bench_demo_rl.py            # from outputs/demo/sft/weights/step_<the SFT preset's steps>
    python benchmarks/rl/bench_demo_rl.py --sft DIR --steps 10 --seed 1 --out outputs/bench-demo-rl
"""

import argparse
import shutil
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/
from benchmarks.common import ROOT, claim_out, fail, load_script  # noqa: E402
from lib.orchestrator.evaluation import paired_gain  # noqa: E402

demo = load_script("demo")  # scripts/demo.py: its stages' commands and evaluation

WRITES = ("eval", "rl")  # what a run writes in --out, beside its record


def main() -> None:
    presets = ROOT / "configs" / "smollm2_two_digit"
    sft_steps = tomllib.loads((presets / "sft.toml").read_text())["steps"]
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sft", type=Path, default=Path(f"outputs/demo/sft/weights/step_{sft_steps}"))
    parser.add_argument("--steps", type=int, default=None, help="RL steps (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench-demo-rl"))
    args = parser.parse_args()
    if not (args.sft / "config.json").is_file():
        fail(f"no SFT weights in {args.sft}: run `make demo` first, or give --sft DIR.")
    if args.sft.resolve().is_relative_to(args.out.resolve()):
        fail(f"--sft {args.sft} is inside --out {args.out}, which the run starts over: give another --out.")
    cfg = demo.resolved(demo.Config(out=args.out, rl_steps=args.steps, seed=args.seed))
    claim_out(args.out, __file__, WRITES, {"sft": str(args.sft), "steps": cfg.rl_steps, "seed": cfg.seed})
    for name in WRITES:  # this benchmark's own, from an earlier run (claim_out has checked)
        shutil.rmtree(args.out / name, ignore_errors=True)
    start = time.perf_counter()
    before, after = args.out / "eval" / "before-rl", args.out / "eval" / "after-rl"
    demo.evaluate(cfg, args.sft, before)
    rl = args.out / "rl"
    demo.run(
        *["scripts/rl.py", "@", f"configs/{cfg.presets}/rl.toml", "--model.name", str(args.sft)],
        *["--steps", str(cfg.rl_steps), "--output-dir", str(rl), "--seed", str(cfg.seed)],
    )
    demo.evaluate(cfg, rl / "weights" / f"step_{cfg.rl_steps}", after)
    minutes = (time.perf_counter() - start) / 60
    gain, error = paired_gain(before, after)
    greedy_gain, greedy_error = paired_gain(demo.greedy(before), demo.greedy(after))
    print(f"\nRL from {args.sft}, {cfg.rl_steps} steps, seed {cfg.seed}, {minutes:.1f} min")
    print(f"held-out reward, sampled: {demo.reward(before):.3f} -> {demo.reward(after):.3f}")
    errors = gain / error if error else float("inf")
    print(f"held-out gain, sampled: {gain:+.3f} +- {error:.3f} ({errors:.1f} standard errors)")
    print(f"held-out gain, greedy:  {greedy_gain:+.3f} +- {greedy_error:.3f}")


if __name__ == "__main__":
    main()
