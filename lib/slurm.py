"""SLURM jobs: the sbatch script that runs a stage's config on inference nodes and trainer nodes (scripts/slurm.py)."""

import dataclasses
import json
import os
import re
import shlex
from pathlib import Path
from typing import Literal

from lib.config import KEY_VARIABLE, UserError, preset_to_flags

# Flag names that carry a secret, however spelled (api_key, access-key, HF_TOKEN, db.password, credentials,
# hf-auth...); a tokenizer, a count of tokens (max-num-batched-tokens) or token ids are no secret.
SECRET_NAME = re.compile(r"key|secret|passw(or)?d|credential|auth|token(?!s|iz|[-_.]?ids?\b)", re.IGNORECASE)


@dataclasses.dataclass
class SlurmConfig:
    inference_nodes: int | None = None
    """RL: nodes that serve the policy (default 1; 0 = rl.py starts its server beside rank 0, as on one
    machine). SFT runs on trainer nodes only."""
    trainer_nodes: int = 1
    """Nodes running torchrun; the first hosts the rendezvous and global rank 0 (the controller)."""
    gpus_per_node: int = 8
    """GPUs on every node (`#SBATCH --gpus-per-node`); 0 = CPU nodes: one trainer process and one engine each."""
    engine: Literal["vllm", "torch"] = "vllm"
    """Inference engine: vllm (one data-parallel endpoint: the first inference node is the head, the others
    headless) or torch (the builtin engine: one independent server per node, rl.py spreads groups over them)."""
    tensor_parallel_size: int = 1
    """vLLM: GPUs per model replica; each inference node runs gpus_per_node / tensor_parallel_size replicas."""
    partition: str | None = None
    """`#SBATCH --partition`."""
    account: str | None = None
    """`#SBATCH --account`."""
    time: str | None = None
    """`#SBATCH --time`, e.g. 24:00:00."""
    sbatch: list[str] = dataclasses.field(default_factory=list)
    """More `#SBATCH` options, written without their dashes: constraint=h100 becomes `#SBATCH --constraint=h100`."""
    setup: list[str] = dataclasses.field(default_factory=list)
    """Shell lines run before anything starts, e.g. "module load cuda/12.4" (every component inherits them)."""
    serve: list[str] = dataclasses.field(default_factory=list)
    """More serve.py flags for every inference node, without their dashes: vllm.cpu-kv-cache-gib=4 passes
    `--vllm.cpu-kv-cache-gib 4` (and a name alone, a switch)."""
    port: int = 8000
    """HTTP port of the inference servers."""
    rpc_port: int = 13345
    """vLLM data parallel over several nodes: the head's RPC port."""
    rendezvous_port: int = 29500
    """torchrun's rendezvous port on the first trainer node."""
    server_timeout: int = 1800
    """Seconds the job waits for the inference servers' /health before it gives up."""
    script: Path | None = None
    """Where to write the script (default: output_dir/slurm/job.sh, beside the jobs' logs)."""

    def __post_init__(self):
        if self.trainer_nodes < 1 or (self.inference_nodes or 0) < 0 or self.gpus_per_node < 0:
            raise UserError("slurm.trainer_nodes must be >= 1, slurm.inference_nodes and gpus_per_node >= 0.")
        if self.tensor_parallel_size < 1 or self.gpus_per_node % self.tensor_parallel_size:
            raise UserError("slurm.gpus_per_node must be a multiple of slurm.tensor_parallel_size.")
        if self.engine == "torch" and self.tensor_parallel_size > 1:  # serve.py would refuse it on every node
            raise UserError(
                f"slurm.tensor_parallel_size {self.tensor_parallel_size} needs slurm.engine vllm: the builtin "
                "engine serves a model on one device."
            )
        if self.server_timeout < 1:
            raise UserError("slurm.server_timeout must be a positive number of seconds.")


def changed_flags(config_class: type, config, leave_out: set[str]) -> list[str]:
    """The CLI flags that rebuild `config` (an instance of config_class or of a subclass) from
    config_class's defaults: one for every value that differs, nested tables included."""

    def plain(value):  # what TOML would have held: the flags come out as they would from a preset
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, tuple | list):
            return [plain(v) for v in value]
        return str(value) if isinstance(value, Path) else value

    default, given = dataclasses.asdict(config_class()), plain(dataclasses.asdict(config))
    leaves = []  # ({key: value} or {table: {key: value}}) for each value that differs
    for key, value in given.items():
        if key in leave_out or key not in default:
            continue
        if isinstance(value, dict):
            leaves += [{key: {k: v}} for k, v in value.items() if v != plain(default[key][k])]
        elif value != plain(default[key]):
            leaves.append({key: value})
    flags = []
    for leaf in leaves:  # each comes out as its flag, then its values: the flag gets the CLI's dashes
        flag, *values = preset_to_flags(config_class, leaf)
        flags += [flag.replace("_", "-"), *values]
    return flags


def find_api_keys(value, path: str = "") -> list[str]:
    """The dotted names of every api_key a config sets."""
    if dataclasses.is_dataclass(value):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if not isinstance(value, dict):
        return []
    found = [f"{path}{k}" for k, v in value.items() if k == "api_key" and v]
    return found + [n for k, v in value.items() for n in find_api_keys(v, f"{path}{k}.")]


def check_no_secrets(cluster: SlurmConfig) -> None:
    """Refuses a secret the job would write into its script, and so onto the nodes' command lines (`ps`):
    a serve.py flag named like one (vLLM's passed-through flags included), or the key's own value."""
    for option in cluster.serve:
        name, _, value = option.partition("=")
        for flag in [name, *re.findall(r"(?:^|\s)--?([^\s=]+)", value)]:
            if SECRET_NAME.search(flag):
                raise UserError(
                    f"slurm.serve {flag!r} would put a secret on the inference nodes' command lines, where "
                    f"anyone there sees it: drop it and export it before sbatch instead ({KEY_VARIABLE} for "
                    "the servers' key; the job passes its environment on)."
                )
    key = os.environ.get(KEY_VARIABLE)
    for field in ("serve", "setup", "sbatch"):
        if key and any(key in text for text in getattr(cluster, field)):
            raise UserError(
                f"slurm.{field} holds the value of ${KEY_VARIABLE}, which would be written into the job's "
                "script: drop it, the job passes the key on from the environment sbatch runs in."
            )


def serve_lines(run, cluster: SlurmConfig, nodes: int) -> tuple[list[str], list[str]]:
    """The bash lines that start the inference nodes' servers, and the servers' base URLs (bash words)."""
    cpu = cluster.gpus_per_node == 0 or run.model.device == "cpu"
    dtype = run.model.dtype if run.model.dtype != "auto" else ("float32" if cpu else "bfloat16")
    common = ["--model.name", run.model.name, "--model.dtype", dtype, "--engine", cluster.engine]
    config = Path(run.model.name) / "config.json"  # a local model: its own limit (vLLM refuses more)
    limit = json.loads(config.read_text()).get("max_position_embeddings") if config.is_file() else None
    common += ["--port", str(cluster.port), "--max-model-len", str(min(run.seq_len, limit or run.seq_len))]
    if run.lora.rank and run.inference.lora_sync == "adapter":
        common += ["--max-lora-rank", str(run.lora.rank)]
    if cluster.tensor_parallel_size > 1:
        common += ["--vllm.tensor-parallel-size", str(cluster.tensor_parallel_size)]
    for option in cluster.serve:
        name, given, value = option.partition("=")
        common += [f"--{name}", *([value] if given else [])]
    common = wrap([shlex.quote(word) for word in common])
    local = max(1, cluster.gpus_per_node // cluster.tensor_parallel_size)  # replicas on one node
    data_parallel = cluster.engine == "vllm" and nodes > 1  # one endpoint: the head's, every engine behind it
    lines = ['serve=("$PYTHON" "$SCRIPTS/serve.py" --weights-root "$RUN_DIR" \\', f"    {common})"]
    lines += [f'address_{i}=$(address "${{inference[{i}]}}")' for i in range(nodes)]
    urls = []
    for i in range(nodes):
        flags = []
        if data_parallel:
            size = f"--vllm.data-parallel-size {local * nodes} --vllm.data-parallel-size-local {local}"
            head = (
                f'--vllm.data-parallel-address "$address_0" --vllm.data-parallel-rpc-port {cluster.rpc_port}'
            )
            flags += [size, head]
            if i > 0:
                flags += ["--vllm.headless", f"--vllm.data-parallel-start-rank {i * local}"]
        elif cluster.engine == "vllm" and local > 1:
            flags += [f"--vllm.data-parallel-size {local}"]
        start = f'start inference-{i} srun --nodes=1 --ntasks=1 --nodelist="${{inference[{i}]}}" '
        start += f'--output="$LOGS/inference-{i}.log" \\\n    '
        lines.append(start + wrap(['"${serve[@]}"', "--host", f'"$address_{i}"', *flags]))
        if not data_parallel or i == 0:
            urls.append(f'"http://$address_{i}:{cluster.port}/v1"')
    return lines, urls


HEADER = """#!/bin/bash
# plainrl {{stage}} job, written by scripts/slurm.py from the run's presets and flags: {{shape}}.
# Submit with the key in the environment, never in this file: PLAINRL_API_KEY=... sbatch {{script}}
# Every submission passes --resume: a second one continues from the run's last checkpoint.
"""

BODY = """
set -uo pipefail
RUN_DIR={{run_dir}}  # on a file system every node sees
PYTHON={{python}}
TORCHRUN={{torchrun}}
SCRIPTS={{scripts}}
LOGS=$RUN_DIR/slurm/$SLURM_JOB_ID
mkdir -p "$LOGS" || exit 1
echo "plainrl job $SLURM_JOB_ID: logs in $LOGS"
exec >>"$LOGS/job.log" 2>&1
log() { echo "$(date '+%F %T') $*"; }
{{setup}}
# ---------------------------------------------------------------- nodes
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
inference=("${nodes[@]:0:{{inference_nodes}}}")
trainers=("${nodes[@]:{{inference_nodes}}}")
address() { sinfo --noheader --Node --nodes "$1" --format %o | head -n 1; }  # its NodeAddr
log "job $SLURM_JOB_ID: inference nodes: ${inference[*]:-none}; trainer nodes: ${trainers[*]}"

# ---------------------------------------------------------------- components
pids=() names=()
start() {  # start NAME COMMAND...: runs a component in the background
    local name=$1
    shift
    "$@" &
    pids+=($!) names+=("$name")
    log "started $name"
}
ended() {  # sets ended_name and ended_code for the first component that has exited (empty: none)
    ended_name='' ended_code=''
    for i in "${!pids[@]}"; do
        if ! kill -0 "${pids[i]}" 2>/dev/null; then
            wait "${pids[i]}"
            ended_code=$? ended_name=${names[i]}
            return
        fi
    done
}
finish() {  # finish CODE REASON: logs why, stops every component, ends the job with CODE
    trap - TERM
    log "$2"
    if ((${#pids[@]})); then
        kill -TERM "${pids[@]}" 2>/dev/null  # srun ends its step's tasks on every node
        local deadline=$((SECONDS + 60))
        while ((SECONDS < deadline)) && [[ -n $(jobs -rp) ]]; do sleep 1; done
        kill -KILL "${pids[@]}" 2>/dev/null
    fi
    log "job ends with code $1"
    exit "$1"
}
trap 'finish 143 "SIGTERM (scancel, or the time limit): stopping every component"' TERM
{{key_check}}
# ---------------------------------------------------------------- a shared run dir
marker=$RUN_DIR/.shared-$SLURM_JOB_ID
touch "$marker"
srun --ntasks-per-node=1 --ntasks="$SLURM_JOB_NUM_NODES" bash -c \\
    'test -f "$1" && test -x "$2" || { echo "$(hostname): $1 or $2 is not there" >&2; exit 1; }' _ "$marker" "$PYTHON" ||
    finish 1 "not every node sees $RUN_DIR and $PYTHON: the run dir and the checkout must be on a shared file system"
rm -f "$marker"
{{servers}}
# ---------------------------------------------------------------- trainer
# torchrun on every trainer node; node rank = the task's number in this step, so the first trainer node,
# which hosts the rendezvous, runs global rank 0: the controller, the only rank that writes the run dir.
rendezvous=$(address "${trainers[0]}"):{{rendezvous_port}}
start trainer srun --nodes={{trainer_nodes}} --ntasks={{trainer_nodes}} --ntasks-per-node=1 \\
    --nodelist="$(IFS=,; echo "${trainers[*]}")" --kill-on-bad-exit=1 --output="$LOGS/trainer-%t.log" \\
    bash -c 'exec "$0" --node-rank "$SLURM_PROCID" "$@"' "$TORCHRUN" --nnodes {{trainer_nodes}} \\
    --nproc-per-node {{processes}} --rdzv-endpoint "$rendezvous" "$SCRIPTS/{{stage}}.py" \\
    {{flags}}

# ---------------------------------------------------------------- watch
# The first component to end ends the job, with its exit code: the trainer's normal end (the servers are
# stopped after it) with 0, a server's end, whatever its code, with a failure.
while sleep 2; do
    ended
    [[ -z $ended_name ]] && continue
    [[ $ended_name == trainer && $ended_code == 0 ]] && finish 0 "trainer exited with code 0"
    finish "$((ended_code ? ended_code : 1))" "$ended_name exited with code $ended_code: ending the job (see $LOGS/$ended_name*.log)"
done
"""

SERVERS = """
# ---------------------------------------------------------------- inference nodes
{{lines}}
urls=({{urls}})
deadline=$((SECONDS + {{timeout}}))
for url in "${urls[@]}"; do
    until "$PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "${url%/v1}/health" 2>/dev/null; do
        ended
        [[ -n $ended_name ]] && finish 1 "$ended_name exited with code $ended_code before $url answered (see $LOGS/$ended_name.log)"
        ((SECONDS < deadline)) || finish 1 "${url%/v1}/health did not answer within {{timeout}} s"
        sleep 5
    done
    log "$url answers"
done
"""


def wrap(words: list[str], width: int = 100) -> str:
    """Shell words as continued lines of about `width` characters, each line starting at a --flag."""
    lines = [""]
    for word in words:
        if word.startswith("--") and len(lines[-1]) + len(word) > width:
            lines.append("")
        lines[-1] += (" " if lines[-1] else "") + word
    return " \\\n    ".join(lines)


def fill(template: str, **values: str) -> str:
    """The template with each {{name}} replaced by its value."""
    for key, value in values.items():
        template = template.replace("{{" + key + "}}", value)
    assert "{{" not in template, f"a placeholder was left: {template[template.index('{{') :][:40]}"
    return template


def render(stage: str, run, cluster: SlurmConfig, python: Path, workdir: Path) -> tuple[Path, str]:
    """The sbatch script for `run` (an rl.py or sft.py config, or one that adds fields to it) on `cluster`'s
    nodes, and where it goes. `python` runs the scripts on every node; the job runs in `workdir`."""
    if keys := find_api_keys(run):
        raise UserError(
            f"the job takes the key from the environment only: drop {', '.join(keys)} and export "
            "PLAINRL_API_KEY before sbatch."
        )
    check_no_secrets(cluster)
    inference_nodes = cluster.inference_nodes if cluster.inference_nodes is not None else int(stage == "rl")
    if stage == "sft" and inference_nodes:
        raise UserError("SFT runs on trainer nodes only: leave slurm.inference_nodes out (or 0).")
    if inference_nodes and run.inference.urls:
        raise UserError("the job starts the inference nodes' servers: leave inference.urls empty.")
    run_dir = (workdir / run.output_dir).resolve()
    script = (workdir / (cluster.script or run_dir / "slurm" / "job.sh")).resolve()
    gpus, nodes = cluster.gpus_per_node, inference_nodes + cluster.trainer_nodes
    options = ["job-name=plainrl-" + stage, f"nodes={nodes}", "ntasks-per-node=1", "exclusive", "mem=0"]
    options += ["export=ALL", f"chdir={workdir}", *([f"gpus-per-node={gpus}"] if gpus else [])]
    named = {"partition": cluster.partition, "account": cluster.account, "time": cluster.time}
    options += [f"{k}={v}" for k, v in named.items() if v is not None] + cluster.sbatch
    engine = {"vllm": "vLLM", "torch": "builtin engine"}[cluster.engine]
    shape = f"{inference_nodes} inference node(s) ({engine}), " if inference_nodes else ""
    shape += f"{cluster.trainer_nodes} trainer node(s) (torchrun) with {gpus or 'no'} GPUs each"
    # slurm and dry_run are scripts/slurm.py's own fields, not the stage's.
    flags = changed_flags(type(run), run, leave_out={"output_dir", "resume", "slurm", "dry_run"})
    servers = key_check = ""
    tail = '--output-dir "$RUN_DIR" --resume'
    if inference_nodes:
        lines, urls = serve_lines(run, cluster, inference_nodes)
        servers = fill(
            SERVERS, lines="\n".join(lines), urls=" ".join(urls), timeout=str(cluster.server_timeout)
        )
        tail = '--inference.urls "${urls[@]}" ' + tail
        key_check = (
            '[[ -n ${PLAINRL_API_KEY:-} ]] || finish 2 "PLAINRL_API_KEY is not set: the servers listen on the '
            'network, export the key before sbatch"\n'
        )
    flag_text = wrap([shlex.quote(f) for f in flags])
    header = fill(HEADER, stage=stage, shape=shape, script=shlex.quote(str(script)))
    header += "".join(f"#SBATCH --{option}\n" for option in options)
    return script, header + fill(
        BODY,
        stage=stage,
        run_dir=shlex.quote(str(run_dir)),
        python=shlex.quote(str(python)),
        torchrun=shlex.quote(str(python.parent / "torchrun")),
        scripts=shlex.quote(str(Path(__file__).resolve().parents[1] / "scripts")),
        setup="".join(line + "\n" for line in cluster.setup),
        inference_nodes=str(inference_nodes),
        key_check=key_check,
        servers=servers,
        rendezvous_port=str(cluster.rendezvous_port),
        trainer_nodes=str(cluster.trainer_nodes),
        processes=str(gpus or 1),
        flags=" \\\n    ".join(filter(None, [flag_text, tail])),
    )
