"""The run directory: the name of everything a run writes there (its writers take them from here)."""

from pathlib import Path

CONFIG = "config.toml"  # the resolved config the run started with (lib/checkpoint.py open_run)
RESUMES = "resumes.jsonl"  # a line per resume that changed the config: the changes, the config it took
PROVENANCE = "provenance.json"  # lib/provenance.py
TENSORBOARD = "tb"  # lib/log.py
METRICS = "metrics.jsonl"  # lib/log.py
WANDB = "wandb"  # wandb's own files: wandb.init(dir=run_dir) names the folder
WANDB_ID = "wandb_id"  # lib/log.py: the wandb run a resume continues
WEIGHTS = "weights"  # lib/weights.py
CHECKPOINTS = "checkpoints"  # lib/checkpoint.py
ROLLOUTS = "rollouts"  # rl.py
EVAL = "eval"  # rl.py's evaluations during the run (lib/evaluation.py)
SERVER_LOG = "server.log"  # the server rl.py started (lib/inference.py)
LOSS_CURVE = "loss_curve.png"  # sft.py
REWARD_CURVE = "reward_curve.png"  # rl.py
SLURM = "slurm"  # a SLURM job's script and logs (lib/slurm.py), written before the run starts
EXPORTED = "exported"  # checkpoints written as Hugging Face directories by scripts/export.py
RESTARTED = "restarted"  # earlier runs' outputs, set aside by a restart (lib/checkpoint.py set_aside)

# What a restart moves to restarted/<time>/, and nothing else the directory holds: the job that runs the
# restart (slurm/) and earlier restarts stay; config.toml is copied there, then rewritten.
OUTPUTS = (
    RESUMES,
    PROVENANCE,
    TENSORBOARD,
    METRICS,
    WANDB,
    WANDB_ID,
    WEIGHTS,
    CHECKPOINTS,
    ROLLOUTS,
    EVAL,
    SERVER_LOG,
    LOSS_CURVE,
    REWARD_CURVE,
)
# What a directory may hold before its first run: a SLURM job writes its script there first.
BEFORE_RUN = (SLURM,)


def is_run_dir(path: Path) -> bool:
    """Whether a run wrote in `path`: every run writes config.toml or provenance.json before anything else."""
    return (path / CONFIG).is_file() or (path / PROVENANCE).is_file()
