"""scripts/slurm.py's sbatch scripts, rendered, and run by a real SLURM on this machine.

The `cluster` fixture starts Debian's slurm-wlm (22.05) as a private cluster under a temporary directory:
its own munged (a fresh key; --force, since pytest's directories are not world-executable), slurmctld
and two slurmd on this host (`slurmd -N plainrl1|2` on distinct ports: Debian builds slurm with
MULTIPLE_SLURMD), both nodes at NodeAddr 127.0.0.1. Without cgroups here: proctrack/linuxproc and
task/none. No slurmdbd, so no sacct: `scontrol show job` (MinJobAge keeps a finished job an hour) gives
states and exit codes. ci/run.sh installs the packages; without them these tests skip (fail under CI).

Jobs run the tiny model on CPU nodes with the builtin engine (`--slurm.engine torch`): a vLLM start costs
1-3 minutes here, so vLLM's head and headless lines are checked as text in a rendered two-inference-node
script (vLLM's module entry ignores --headless anyway; tests/test_multinode.py runs that pair by hand).
"""

import os
import re
import secrets
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, load_script

from lib.config import parse
from lib.inference.launch import free_port, free_ports

slurm = load_script("slurm")
rl = load_script("rl")
NODES = ("plainrl1", "plainrl2")


# ---------------------------------------------------------------- rendering


def render(stage: str, args: list[str], workdir: Path) -> tuple[Path, str]:
    from lib.slurm import render as render_script

    cfg = parse(slurm.job_config(stage), args)
    return render_script(stage, cfg, cfg.slurm, python=ROOT / ".venv" / "bin" / "python", workdir=workdir)


def joined(script: str) -> str:
    """The script with its continued lines joined."""
    return re.sub(r"\s*\\\n\s*", " ", script)


def write_script(stage: str, args: list[str], workdir: Path) -> tuple[Path, str]:
    """What `python scripts/slurm.py STAGE ARGS` run in `workdir` writes: the script's path and text."""
    script, text = render(stage, args, workdir)
    script.parent.mkdir(parents=True)
    script.write_text(text)
    return script, text


def test_two_inference_nodes_run_a_vllm_head_and_a_headless_node(tmp_path):
    cluster = tmp_path / "cluster.toml"  # the cluster's shape in a preset, beside flags
    cluster.write_text(
        '[slurm]\ninference_nodes = 2\nsbatch = ["constraint=h100"]\nserve = ["vllm.cpu-kv-cache-gib=2"]\n'
    )
    # A model only the cluster has: no config.json here to lower the server's limit below the run's seq_len
    # (with outputs/tiny/sft from `make sft ENV=tiny` on this machine, its 2048 positions would).
    args = ["@", str(ROOT / "configs/tiny/rl.toml"), "@", str(cluster), "--output-dir", "runs/a"]
    args += ["--model.name", "/cluster/models/tiny"]
    args += ["--slurm.trainer-nodes", "3", "--slurm.gpus-per-node", "4", "--slurm.partition", "gpu"]
    args += ["--slurm.time", "2:00:00", "--slurm.account", "lab", "--slurm.rpc-port", "14000"]
    script, text = render("rl", args, tmp_path)
    assert script == tmp_path / "runs/a/slurm/job.sh"
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # it parses
    options = re.findall(r"^#SBATCH (.*)$", text, re.M)
    for option in ["--nodes=5", "--gpus-per-node=4", "--partition=gpu", "--time=2:00:00", "--account=lab"]:
        assert option in options, options
    assert {"--constraint=h100", "--export=ALL", f"--chdir={tmp_path}"} <= set(options)
    lines = joined(text).splitlines()
    (serve,) = [line for line in lines if line.startswith("serve=(")]
    assert "--engine vllm" in serve and "--model.dtype bfloat16" in serve
    assert "--vllm.cpu-kv-cache-gib 2" in serve and "--max-model-len 4096" in serve
    head, headless = [line for line in lines if line.startswith("start inference-")]
    # 2 nodes x 4 GPUs = 8 engines; the head binds its NodeAddr and every engine points at it
    common = '--vllm.data-parallel-size 8 --vllm.data-parallel-size-local 4 --vllm.data-parallel-address "$address_0" --vllm.data-parallel-rpc-port 14000'
    assert head.endswith(
        f'--nodelist="${{inference[0]}}" --output="$LOGS/inference-0.log" "${{serve[@]}}" --host "$address_0" {common}'
    )
    assert headless.endswith(
        f'"${{serve[@]}}" --host "$address_1" {common} --vllm.headless --vllm.data-parallel-start-rank 4'
    )
    assert 'urls=("http://$address_0:8000/v1")' in lines  # one endpoint: the head's
    (trainer,) = [line for line in lines if line.startswith("start trainer ")]
    assert "--nodes=3 --ntasks=3 --ntasks-per-node=1" in trainer and "--nproc-per-node 4" in trainer
    assert trainer.endswith('--inference.urls "${urls[@]}" --output-dir "$RUN_DIR" --resume')
    assert f"RUN_DIR={tmp_path}/runs/a " in text


def test_the_script_passes_every_changed_setting_and_nothing_else(tmp_path):
    """The run's flags in the script rebuild the very config slurm.py parsed (presets and flags together)."""
    preset = ["@", str(ROOT / "configs/tiny/rl.toml")]
    flags = [
        "--steps",
        "7",
        "--env.mix",
        '{"id": "alphabet_sort", "ratio": 2}',
        "--no-packing",
        "--lora.rank",
        "4",
    ]
    flags += [
        "--sampling.temperature",
        "0.7",
        "--output-dir",
        str(tmp_path / "run"),
        "--inference.port",
        "9000",
    ]
    _, text = render(
        "rl", [*preset, *flags, "--slurm.engine", "torch", "--slurm.gpus-per-node", "0"], tmp_path
    )
    trainer = joined(text).split('"$SCRIPTS/rl.py" ', 1)[1].split(" --inference.urls", 1)[0]
    import shlex

    passed = shlex.split(trainer)
    assert "--resume" not in passed and "--output-dir" not in passed and "--slurm.engine" not in passed
    expected = parse(rl.Config, [*preset, *flags])
    rebuilt = parse(rl.Config, [*passed, "--output-dir", str(tmp_path / "run")])
    assert rebuilt == expected
    assert "--max-lora-rank 4" in text and "--model.dtype float32" in text  # the servers take the adapter


def test_refuses_a_key_in_the_config_and_inference_nodes_for_sft(tmp_path, capsys):
    with pytest.raises(ValueError, match="drop inference.api_key and export PLAINRL_API_KEY"):
        render("rl", ["--inference.api-key", "k", "--output-dir", "r"], tmp_path)
    with pytest.raises(ValueError, match="SFT runs on trainer nodes only"):
        render("sft", ["--slurm.inference-nodes", "1"], tmp_path)
    with pytest.raises(ValueError, match="leave inference.urls empty"):
        render("rl", ["--inference.urls", "http://h:8000/v1"], tmp_path)


def test_refuses_tensor_parallel_servers_on_the_builtin_engine(tmp_path, capsys):
    # Each node's serve.py would refuse the flag (the builtin engine has no tensor parallelism) after sbatch.
    with pytest.raises(SystemExit) as exit_:
        render("rl", ["--slurm.engine", "torch", "--slurm.tensor-parallel-size", "2"], tmp_path)
    assert exit_.value.code == 2
    assert "slurm.tensor_parallel_size 2 needs slurm.engine vllm" in capsys.readouterr().err


def test_refuses_a_secret_passed_to_the_servers_by_name(tmp_path):
    base = ["@", str(ROOT / "configs/tiny/rl.toml"), "--output-dir", "r"]
    named = ["api-key=k", "api_key=k", "API-KEY=k", "vllm.hf-token=t", "db.password=p"]
    for option in [*named, "client_secret"]:
        with pytest.raises(ValueError) as refused:
            render("rl", [*base, "--slurm.serve", option], tmp_path)
        message = str(refused.value)
        assert "PLAINRL_API_KEY" in message and "\n" not in message, message
        assert option.partition("=")[0] in message and "=" not in message, message
    with pytest.raises(ValueError, match="'api-key'"):  # a flag inside vLLM's own passed-through ones
        render("rl", [*base, "--slurm.serve", "vllm.extra-args=--api-key=k"], tmp_path)
    # Names that only look alike stay allowed.
    _, text = render("rl", [*base, "--slurm.serve", "vllm.max-num-batched-tokens=64"], tmp_path)
    assert "--vllm.max-num-batched-tokens 64" in joined(text)


def test_refuses_every_name_that_holds_a_secrets_word_and_not_a_tokenizer_or_a_token_count(tmp_path):
    base = ["@", str(ROOT / "configs/tiny/rl.toml"), "--output-dir", "r"]
    for option in [
        "access-key=k",
        "credentials=c",
        "hf-auth=a",
        "vllm.apikey=k",
        "HF_TOKEN=t",
        "vllm.oauth=o",
    ]:
        with pytest.raises(ValueError, match=f"slurm.serve '{option.partition('=')[0]}' would put a secret"):
            render("rl", [*base, "--slurm.serve", option], tmp_path)
    allowed = ["vllm.tokenizer=t", "vllm.skip-tokenizer-init=true", "vllm.max-num-batched-tokens=64"]
    allowed.append("vllm.return-tokens-as-token-ids=true")
    _, text = render("rl", [*base, "--slurm.serve", *allowed], tmp_path)
    for option in allowed:
        assert "--" + option.replace("=", " ") in joined(text), option


def test_refuses_the_keys_value_anywhere_in_the_scripts_text_without_echoing_it(tmp_path, monkeypatch):
    key = "k3y-" + secrets.token_hex(8)
    monkeypatch.setenv("PLAINRL_API_KEY", key)
    base = ["@", str(ROOT / "configs/tiny/rl.toml"), "--output-dir", "r"]
    for field, value in [("serve", f"vllm.extra-args={key}"), ("setup", f"export K={key}"), ("sbatch", key)]:
        with pytest.raises(ValueError) as refused:
            render("rl", [*base, f"--slurm.{field}", value], tmp_path)
        message = str(refused.value)
        assert f"slurm.{field}" in message and "PLAINRL_API_KEY" in message, message
        assert key not in message and "\n" not in message, message
    _, text = render("rl", [*base, "--slurm.setup", "module load cuda"], tmp_path)  # the key set is fine
    assert key not in text


def test_dry_run_prints_the_script_and_writes_nothing(tmp_path):
    command = [str(ROOT / ".venv/bin/python"), str(ROOT / "scripts/slurm.py"), "sft", "@"]
    command += [
        str(ROOT / "configs/tiny/sft.toml"),
        "--output-dir",
        str(tmp_path / "run"),
        "--slurm.trainer-nodes",
    ]
    command += ["2", "--dry-run"]
    printed = subprocess.run(command, capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert printed.startswith("#!/bin/bash\n# plainrl sft job") and "--nodes=2" in printed
    assert "serve.py" not in printed and "inference-0" not in printed
    assert not (tmp_path / "run").exists()
    written = subprocess.run(command[:-1], capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert (tmp_path / "run" / "slurm" / "job.sh").read_text() == printed and "sbatch" in written


# ---------------------------------------------------------------- a real cluster

SLURM_CONF = """ClusterName=plainrl
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.socket
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
MinJobAge=3600
KillWait=10
NodeName={node_1} NodeAddr=127.0.0.1 Port={node_port_1} CPUs=2 State=UNKNOWN
NodeName={node_2} NodeAddr=127.0.0.1 Port={node_port_2} CPUs=2 State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A private SLURM cluster of two nodes on this host; yields the environment its commands need."""
    if not all(shutil.which(name) for name in ("munged", "slurmctld", "slurmd", "sbatch")):
        message = (
            "SLURM is not installed (ci/run.sh installs Debian's slurmctld, slurmd, slurm-client, munge)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    root = tmp_path_factory.mktemp("slurm")
    (root / "munge.key").write_bytes(secrets.token_bytes(1024))
    (root / "munge.key").chmod(0o600)
    ports = dict(zip(("ctld_port", "slurmd_port", "node_port_1", "node_port_2"), free_ports(4), strict=True))
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(dir=root, node_1=NODES[0], node_2=NODES[1], **ports))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    munge = [f"--socket={root}/munge.socket", f"--key-file={root}/munge.key", f"--pid-file={root}/munged.pid"]
    munge += [f"--log-file={root}/munged.log", f"--seed-file={root}/munged.seed", "--force", "--foreground"]
    quiet = dict(env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # each logs to root/*.log
    daemons = [subprocess.Popen(["munged", *munge], **quiet)]
    try:
        deadline = time.monotonic() + 60
        while not (root / "munge.socket").exists():
            assert daemons[0].poll() is None, (root / "munged.log").read_text()
            assert time.monotonic() < deadline, f"munged made no socket in 60 s; see {root}/munged.log"
            time.sleep(0.1)
        daemons.append(subprocess.Popen(["slurmctld", "-D", "-f", str(conf)], **quiet))
        daemons += [
            subprocess.Popen(["slurmd", "-D", "-f", str(conf), "-N", node], **quiet) for node in NODES
        ]
        deadline = time.monotonic() + 60
        while sinfo(env) != {node: "idle" for node in NODES}:
            assert time.monotonic() < deadline, f"nodes not idle: {sinfo(env)}; see {root}/*.log"
            assert all(d.poll() is None for d in daemons), f"a SLURM daemon exited; see {root}/*.log"
            time.sleep(0.5)
        yield env
    finally:
        subprocess.run(["scancel", "--user=root"], env=env, capture_output=True)
        deadline = time.monotonic() + 30
        while squeue(env) and time.monotonic() < deadline:
            time.sleep(0.5)
        for daemon in reversed(daemons):
            daemon.terminate()
            daemon.wait(timeout=30)


def sinfo(env: dict) -> dict[str, str]:
    run = subprocess.run(
        ["sinfo", "--noheader", "--Node", "--format", "%N %T"], env=env, capture_output=True, text=True
    )
    return dict(line.split() for line in run.stdout.splitlines())


def squeue(env: dict) -> list[str]:
    return subprocess.run(["squeue", "--noheader"], env=env, capture_output=True, text=True).stdout.split()


def show_job(env: dict, job: str) -> str:
    return subprocess.run(
        ["scontrol", "-dd", "show", "job", job], env=env, capture_output=True, text=True
    ).stdout


def job_field(env: dict, job: str, name: str) -> str:
    return re.search(rf"\b{name}=(\S+)", show_job(env, job)).group(1)


def submit(env: dict, script: Path) -> str:
    return subprocess.run(
        ["sbatch", "--parsable", str(script)], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def wait_for(env: dict, job: str, timeout: float) -> str:
    """The job's final state."""
    deadline = time.monotonic() + timeout
    while (state := job_field(env, job, "JobState")) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
        assert time.monotonic() < deadline, f"job {job} still {state} after {timeout} s"
        time.sleep(0.5)
    return state


class ArgvWatch:
    """Reads every process's command line on this machine, over and over, while a job runs: records those that hold `secret`."""

    def __init__(self, secret: str):
        self.secret, self.seen, self.found = secret.encode(), 0, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()

    def watch(self) -> None:
        while not self.stop.wait(0.2):
            for path in Path("/proc").glob("[0-9]*/cmdline"):
                try:
                    argv = path.read_bytes()
                except OSError:
                    continue
                self.seen += 1
                if self.secret in argv:
                    self.found.append(argv.replace(b"\0", b" ").decode(errors="replace"))

    def close(self) -> list[str]:
        self.stop.set()
        self.thread.join()
        return self.found


def test_the_cluster_runs_two_slurmd_nodes_on_this_host(cluster):
    config = subprocess.run(
        ["scontrol", "show", "config"], env=cluster, capture_output=True, text=True
    ).stdout
    assert re.search(r"MULTIPLE_SLURMD\s*= Yes", config) and "proctrack/linuxproc" in config
    assert sinfo(cluster) == {"plainrl1": "idle", "plainrl2": "idle"}


def rl_args(tiny_dir: Path, out: Path, steps: int) -> list[str]:
    args = ["@", str(ROOT / "configs/tiny/rl.toml"), "--model.name", str(tiny_dir), "--output-dir", str(out)]
    args += [
        "--steps",
        str(steps),
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "5",
        "--examples-per-step",
        "4",
    ]
    args += ["--rollouts-per-example", "4", "--sampling.max-tokens", "24", "--seq-len", "256"]
    port, rendezvous_port = free_ports(2)
    args += ["--slurm.gpus-per-node", "0", "--slurm.engine", "torch", "--slurm.port", str(port)]
    return [*args, "--slurm.rendezvous-port", str(rendezvous_port)]


def job_env(cluster: dict, key: str) -> dict:
    return {**cluster, "PLAINRL_API_KEY": key, "OMP_NUM_THREADS": "1"}


def checkpoints(out: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("step_*"))


@pytest.mark.slow
def test_rl_job_runs_an_inference_node_and_a_trainer_node_and_keeps_the_key_secret(
    cluster, tiny_dir, tmp_path
):
    out = tmp_path / "run"
    script, text = write_script("rl", rl_args(tiny_dir, out, steps=2), tmp_path)
    key = "plainrl-test-" + secrets.token_hex(8)
    watch = ArgvWatch(key)
    try:
        job = submit(job_env(cluster, key), script)
        state = wait_for(cluster, job, timeout=240)
    finally:
        found = watch.close()
    logs = out / "slurm" / job
    assert state == "COMPLETED" and job_field(cluster, job, "ExitCode") == "0:0", (
        logs / "job.log"
    ).read_text()
    assert job_field(cluster, job, "NodeList") == "plainrl[1-2]"
    assert checkpoints(out) == [1, 2]
    job_log = (logs / "job.log").read_text()
    assert (
        "inference nodes: plainrl1; trainer nodes: plainrl2" in job_log
        and "trainer exited with code 0" in job_log
    )
    assert "loaded weights from" in (logs / "inference-0.log").read_text()  # the trainer's syncs reached it
    assert "step 2" in (logs / "trainer-0.log").read_text()
    # The key: in no file the job wrote, not in the script, not in scontrol's view, in no command line.
    written = [path for path in out.rglob("*") if path.is_file()]
    assert len(written) > 10 and not [path for path in written if key.encode() in path.read_bytes()]
    assert key not in text and key not in show_job(cluster, job)
    assert watch.seen > 1000 and found == [], found


@pytest.mark.slow
def test_a_killed_trainer_ends_the_job_with_the_reason_and_a_resubmission_resumes(
    cluster, tiny_dir, tmp_path
):
    out = tmp_path / "run"
    script, text = write_script("rl", rl_args(tiny_dir, out, steps=4), tmp_path)
    job, state, took = start_and_kill_at_step_1(cluster, script, out, "rl.py")
    last = checkpoints(out)[-1]
    job_log = (out / "slurm" / job / "job.log").read_text()
    assert state == "FAILED" and job_field(cluster, job, "ExitCode") != "0:0", job_log
    assert re.search(r"trainer exited with code [1-9]\d*: ending the job", job_log), job_log
    assert took < 60, took
    print(f"the job ended {took:.1f} s after the trainer's kill -9, with checkpoints up to step {last}")
    again = submit(job_env(cluster, "plainrl-test-" + secrets.token_hex(8)), script)
    assert wait_for(cluster, again, timeout=240) == "COMPLETED", (
        out / "slurm" / again / "job.log"
    ).read_text()
    assert f"(step {last})" in (out / "slurm" / again / "trainer-0.log").read_text()  # resumed
    assert last < 4 and checkpoints(out)[-1] == 4


def process_in(job: str, script: str) -> int:
    """The pid of scripts/<script> running inside `job` (for rl.py, torchrun's worker, not torchrun)."""
    for path in Path("/proc").glob("[0-9]*"):
        try:
            argv = (path / "cmdline").read_bytes().split(b"\0")
            environ = (path / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() in environ and any(
            a.endswith(f"scripts/{script}".encode()) for a in argv
        ):
            if not any(b"torchrun" in a for a in argv):
                return int(path.name)
    raise AssertionError(f"no scripts/{script} process in job {job}")


def job_logs(out: Path, job: str) -> str:
    """Every log the job wrote, each under its name: what a failed assertion shows."""
    folder = out / "slurm" / job
    return "\n".join(f"== {path.name}\n{path.read_text()}" for path in sorted(folder.glob("*.log")))


def start_and_kill_at_step_1(cluster: dict, script: Path, out: Path, victim: str) -> tuple[str, str, float]:
    """Submits `script`, kill -9s its scripts/<victim> process once checkpoints/step_1 exists; returns the job,
    its final state and the seconds from the kill to the job's end."""
    job = submit(job_env(cluster, "plainrl-test-" + secrets.token_hex(8)), script)
    deadline = time.monotonic() + 180
    while not (out / "checkpoints" / "step_1").exists():
        state = job_field(cluster, job, "JobState")
        assert time.monotonic() < deadline and state in ("PENDING", "RUNNING"), (state, job_logs(out, job))
        time.sleep(0.05)
    os.kill(process_in(job, victim), 9)
    killed = time.monotonic()
    state = wait_for(cluster, job, timeout=120)
    return job, state, time.monotonic() - killed


@pytest.mark.slow
def test_a_dead_server_ends_the_job_and_its_trainer_with_the_reason(cluster, tiny_dir, tmp_path):
    """The complaint this answers: a job that keeps its nodes after a component died, GPUs idle, no log."""
    out = tmp_path / "run"
    script, text = write_script("rl", rl_args(tiny_dir, out, steps=50), tmp_path)
    job, state, took = start_and_kill_at_step_1(cluster, script, out, "serve.py")
    job_log = (out / "slurm" / job / "job.log").read_text()
    assert state == "FAILED" and re.search(r"inference-0 exited with code \d+: ending the job", job_log), (
        job_log
    )
    assert took < 60, took
    print(f"the job ended {took:.1f} s after the server's kill -9")
    with pytest.raises(AssertionError, match="no scripts/rl.py process"):
        process_in(job, "rl.py")  # the trainer went with it


@pytest.mark.slow
def test_sft_job_runs_torchrun_on_two_trainer_nodes(cluster, tiny_dir, tmp_path):
    out = tmp_path / "sft"
    args = ["@", str(ROOT / "configs/tiny/sft.toml"), "--model.name", str(tiny_dir), "--output-dir", str(out)]
    args += [
        "--steps",
        "2",
        "--batch-size",
        "8",
        "--micro-batch-size",
        "2",
        "--seq-len",
        "256",
        "--checkpoint-every",
        "1",
    ]
    args += ["--data.num-examples", "16", "--slurm.trainer-nodes", "2", "--slurm.gpus-per-node", "0"]
    script, text = write_script("sft", [*args, "--slurm.rendezvous-port", str(free_port())], tmp_path)
    job = submit(job_env(cluster, ""), script)
    state = wait_for(cluster, job, timeout=240)
    logs = out / "slurm" / job
    assert state == "COMPLETED" and job_field(cluster, job, "ExitCode") == "0:0", (
        logs / "job.log"
    ).read_text()
    assert checkpoints(out) == [1, 2]
    assert sorted(p.name for p in logs.iterdir()) == ["job.log", "trainer-0.log", "trainer-1.log"]
    assert "2 x cpu" in (logs / "trainer-0.log").read_text()  # one rank on each node
