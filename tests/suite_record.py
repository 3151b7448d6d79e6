"""Where the suite's time goes. As a pytest plugin (tests/conftest.py loads it) it writes
outputs/test-report.json at the end of every session: each test's seconds (setup, call, teardown) and what it
started, seen by watching /proc for new processes while it ran (inference servers, vLLM among them, the
plainrl scripts run as subprocesses, torchrun) and the fixtures it used (the shared servers, SmolLM2, the
SLURM cluster). Run as a script it prints the
tables of docs/testing.md from such a file:

    python tests/suite_record.py [outputs/test-report.json]
"""

import collections
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "outputs" / "test-report.json"
POLL_S = 0.2  # a server or a script lives for seconds at least; 0.2 s of polling costs ~1% of a core
SHARED_SERVERS = ("vllm_server", "smollm2_vllm_server")
# The fixtures that say what a test uses beyond the processes it starts (SLURM's daemons are not its children).
NOTED = {*SHARED_SERVERS, "smollm2_dir", "cluster", "trained_tiny", "tool_caller"}
SMOLLM2 = "smollm2-135m-instruct"


def kinds(argv: list[str]) -> set[str]:
    """What a process started by a test is, from its command line: "vllm" (a vLLM server: serve.py before it
    execs vLLM, or vLLM itself), "builtin" (serve.py with the builtin engine), "script" (sft.py, rl.py, eval.py
    and the others), "torchrun", and "smollm2" besides when it is given SmolLM2's directory."""
    line, found = " ".join(argv), set()
    script = next((Path(arg).name for arg in argv[1:3] if arg.startswith(str(ROOT / "scripts"))), None)
    script = script or next((arg for arg in argv[1:3] if arg.startswith("scripts/")), None)
    if "lib.inference.vllm" in argv or "vllm.entrypoints" in line or (argv[:2] and argv[1:2] == ["serve"]):
        found.add("vllm")
    elif script and script.endswith("serve.py"):
        found.add("vllm" if "--engine vllm" in line or "--engine=vllm" in line else "builtin")
    elif script:
        found.add("script")
    if "torch.distributed.run" in line or any(Path(arg).name == "torchrun" for arg in argv[:2]):
        found.add("torchrun")
    if found and SMOLLM2 in line:
        found.add("smollm2")
    return found


class Watcher:
    """Polls /proc in a thread; `take()` returns what started since the last take: {kind: count}."""

    def __init__(self):
        self.seen: dict[int, set[str]] = {}
        self.counts: collections.Counter = collections.Counter()
        self.lock = threading.Lock()
        threading.Thread(target=self.poll, daemon=True).start()

    def poll(self) -> None:
        own = os.getpid()
        while True:  # a daemon thread: it ends with the session's process
            time.sleep(POLL_S)
            parents = {}
            for entry in os.scandir("/proc"):
                try:  # the field after the command's name in parentheses: state, then the parent's pid
                    parents[int(entry.name)] = int(
                        Path(entry.path, "stat").read_text().rpartition(")")[2].split()[1]
                    )
                except (OSError, ValueError, IndexError):
                    continue
            for pid, parent in parents.items():
                if not self.descends(pid, own, parents):  # another session's, or SLURM's daemons'
                    continue
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
                except OSError:
                    continue
                new = kinds(argv) - self.seen.get(pid, set())
                if new:  # a forked worker keeps its parent's command line: no start of its own
                    with self.lock:
                        self.seen.setdefault(pid, set()).update(new)
                        self.counts.update(new - self.seen.get(parent, set()))

    @staticmethod
    def descends(pid: int, ancestor: int, parents: dict[int, int]) -> bool:
        while pid > 1 and pid != ancestor:
            pid = parents.get(pid, 0)
        return pid == ancestor

    def take(self) -> dict[str, int]:
        with self.lock:
            taken, self.counts = dict(self.counts), collections.Counter()
        return taken


watcher: Watcher | None = None
tests: dict[str, dict] = {}
began = time.monotonic()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In the process that runs the tests (a pytest-xdist worker, or pytest itself): what started since the
    last report rides on this one, so pytest-xdist brings it to the process that writes the file."""
    global watcher
    report = (yield).get_result()
    if watcher is None and Path("/proc/self/stat").exists():
        watcher = Watcher()
    report.plainrl_started = watcher.take() if watcher else {}
    report.plainrl_fixtures = sorted(set(item.fixturenames) & NOTED)


def pytest_runtest_logreport(report):
    test = tests.setdefault(report.nodeid, {"seconds": {}, "started": {}, "outcome": "passed"})
    test["seconds"][report.when] = round(report.duration, 2)
    if report.failed or (report.skipped and report.when != "teardown"):
        test["outcome"] = report.outcome
    for kind, count in getattr(report, "plainrl_started", {}).items():
        test["started"][kind] = test["started"].get(kind, 0) + count
    test["fixtures"] = getattr(report, "plainrl_fixtures", [])


def pytest_sessionfinish(session):
    ran = {nodeid: test for nodeid, test in tests.items() if test["seconds"]}
    if not ran or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "wall_s": round(time.monotonic() - began, 1),
        "workers": getattr(session.config.option, "numprocesses", None) or 1,
        "tests": ran,
    }
    REPORT.with_suffix(".tmp").write_text(json.dumps(report, indent=1))
    REPORT.with_suffix(".tmp").replace(REPORT)


def category(test: dict) -> str:
    """The costliest thing a test starts or uses, for the table by what tests start."""
    started, fixtures = test["started"], test.get("fixtures", [])
    if started.get("vllm"):
        return "starts its own vLLM server(s)"
    if set(SHARED_SERVERS) & set(fixtures):
        return "uses a session's shared vLLM server"
    if "cluster" in fixtures:
        return "SLURM jobs (a private cluster)"
    if started.get("torchrun"):
        return "multi-process runs (torchrun, two nodes)"
    if started.get("smollm2") or "smollm2_dir" in fixtures:
        return "SmolLM2 (loaded in the test or a script)"
    if started.get("script") or started.get("builtin"):
        return "plainrl scripts as subprocesses, builtin servers"
    return "in the test's process only"


def tables(report: dict) -> str:
    tests = report["tests"]
    total = sum(sum(t["seconds"].values()) for t in tests.values())
    by_file, by_kind = collections.defaultdict(list), collections.defaultdict(list)
    for nodeid, test in tests.items():
        seconds = sum(test["seconds"].values())
        by_file[nodeid.partition("::")[0]].append(seconds)
        by_kind[category(test)].append(seconds)
    starts = collections.Counter()
    for test in tests.values():
        starts.update(test["started"])
    lines = [
        f"{len(tests)} tests in {report['wall_s'] / 60:.1f} min on {report['workers']} worker(s), their setup, call"
        f" and teardown {total / 60:.1f} min in all (finished {report['finished']})",
        "",
    ]
    lines += ["| file | tests | minutes | share |", "|---|---|---|---|"]
    for name, times in sorted(by_file.items(), key=lambda item: -sum(item[1])):
        lines.append(f"| {name} | {len(times)} | {sum(times) / 60:.1f} | {sum(times) / total:.0%} |")
    lines += ["", "| what the test starts | tests | minutes | share |", "|---|---|---|---|"]
    for name, times in sorted(by_kind.items(), key=lambda item: -sum(item[1])):
        lines.append(f"| {name} | {len(times)} | {sum(times) / 60:.1f} | {sum(times) / total:.0%} |")
    names = {
        "vllm": "vLLM servers",
        "builtin": "builtin servers",
        "script": "plainrl scripts",
        "torchrun": "torchrun",
    }
    counted = ", ".join(f"{names[kind]} {starts[kind]}" for kind in names)
    lines += ["", f"processes started: {counted}; given SmolLM2's directory: {starts['smollm2']}"]
    users = sum(1 for t in tests.values() if "smollm2_dir" in t.get("fixtures", []))
    lines.append(f"tests using SmolLM2 (each loads it at least once, in its process or a server): {users}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(tables(json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else REPORT).read_text())))
