"""Writes the sbatch script that runs an rl.py or sft.py config on a SLURM cluster.

Takes the stage, then the same `@` presets and flags as rl.py or sft.py, plus the cluster's shape as
`--slurm.*` flags (or a `[slurm]` table in a preset). The script, when SLURM runs it:
- checks that every node sees the run dir (`--output-dir`, made absolute) and this checkout: both must
  be on a shared file system;
- RL: starts scripts/serve.py on the inference nodes (vLLM: the first node is the data-parallel head, the
  others headless engines behind its endpoint; the builtin engine: one server per node), waits for
  /health, then torchrun on the trainer nodes (rendezvous and global rank 0 on the first), attached to
  the servers; SFT: trainer nodes only;
- passes the key from the submitting environment (PLAINRL_API_KEY, with `#SBATCH --export=ALL`): it is
  never written into the script, the logs or a command line;
- writes each component's log to output_dir/slurm/JOB_ID/ (job.log, inference-N.log, trainer-N.log);
- always passes `--resume`: submitting the same script again continues from the last checkpoint;
- ends the whole job when any component ends, the reason in job.log: with the trainer's exit code when
  the trainer ends (the servers are stopped after it), with code 1 when a server dies first.
The run's flags in the script are those that differ from the stage's defaults (presets included).

Usage:
    python scripts/slurm.py rl @ configs/reverse_text/rl.toml --output-dir /shared/runs/rt --slurm.inference-nodes 2 --slurm.trainer-nodes 2 --slurm.partition gpu --slurm.time 12:00:00
    PLAINRL_API_KEY=$(cat ~/.plainrl_key) sbatch /shared/runs/rt/slurm/job.sh
    python scripts/slurm.py sft @ configs/reverse_text/sft.toml --output-dir /shared/runs/sft --slurm.trainer-nodes 4 --dry-run
    python scripts/slurm.py rl @ configs/tiny/rl.toml --output-dir /shared/tiny --slurm.gpus-per-node 0 --slurm.engine torch   # CPU nodes
"""

import dataclasses
import importlib.util
import signal
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # finds lib/ outside the virtualenv too
import lib.venv  # noqa: F401  (first: says which python to use when the dependencies are missing)
from lib.config import fail, parse, run_main
from lib.slurm import SlurmConfig, render

ROOT = Path(__file__).resolve().parents[1]


def stage_config(stage: str) -> type:
    """rl.py's or sft.py's Config (scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"plainrl_script_{stage}", ROOT / "scripts" / f"{stage}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # tyro reads its docstrings
    spec.loader.exec_module(module)
    return module.Config


def job_config(stage: str) -> type:
    """The stage's Config with the cluster's settings beside it (`--slurm.*`) and `--dry-run`."""

    @dataclasses.dataclass
    class Job(stage_config(stage)):
        slurm: SlurmConfig = dataclasses.field(default_factory=SlurmConfig)
        """The cluster's shape and the sbatch options."""
        dry_run: bool = False
        """Print the script instead of writing it."""

    return Job


def main(stage: str, cfg) -> str:
    """Writes (or, with --dry-run, prints) the script and returns it."""
    script, text = render(stage, cfg, cfg.slurm, python=Path(sys.executable), workdir=Path.cwd())
    if cfg.dry_run:
        print(text, end="")
        return text
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(text)
    print(f"wrote {script}: submit it with PLAINRL_API_KEY in the environment, `sbatch {script}`")
    return text


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("rl", "sft"):
        if {"-h", "--help"} & set(sys.argv[1:2]):
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `--help | head` ends quietly
            print(__doc__)
            raise SystemExit(0)
        fail("the first argument is the stage: rl or sft (then its presets and flags, and --slurm.*).")
    stage = sys.argv[1]
    config = parse(job_config(stage), sys.argv[2:], description=__doc__)
    run_main(lambda cfg: main(stage, cfg), config)
