"""Gathers, here, the wheels plainrl needs on a lent GPU machine (Python 3.12, manylinux x86-64, no network),
and checks that they resolve together with that machine's own packages.

The machine's packages (benchmarks/gpu/gpu_machine_packages.txt) stay as they are, torch above all: its CUDA
build is GBs and cannot travel. Everything else plainrl needs, pyproject's dependencies and what they
need in turn (each wheel's Requires-Dist, markers for Python 3.12 on Linux x86-64), is downloaded at
requirements.lock's version. Two of plainrl's ranges do not apply there and are relaxed, not carried:
torch==2.13.0 (the machine's torch runs plainrl from the source tree; benchmarks/gpu/gpu_check.py fails in
one sentence where an API plainrl calls is missing) and numpy<2.4 (for vLLM's mistral-common; no vLLM
there). Any other machine package whose version, where known, falls outside a range plainrl or a carried
wheel asks for is carried at the lock's version instead (it then shadows the machine's), and said so.

The check: `pip install --dry-run --no-index --ignore-installed` for CPython 3.12 on manylinux x86-64
resolves plainrl's requirements (the two relaxed) from the folder and one stub wheel per machine package
(its name and version, no files; the lock's version where the machine's was never read) and must use
every wheel in the folder. Stale wheels in the folder (another lock) are removed: the folder must be new or
empty, or one this script gathered (its record, gather_gpu_wheels.json, and wheels, nothing else).

Usage:
    python benchmarks/gpu/gather_gpu_wheels.py                  # gpu-wheels/ (make gpu-wheels runs the same)
    python benchmarks/gpu/gather_gpu_wheels.py --out /tmp/wheels --check-only
then on the GPU machine: python3 benchmarks/gpu/gpu_check.py --wheels gpu-wheels
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/
from benchmarks.common import ROOT, claim_out  # noqa: E402

MACHINE_FILE = ROOT / "benchmarks" / "gpu" / "gpu_machine_packages.txt"
PYTHON = "3.12"
# The machine's glibc is 2.39 (Ubuntu 24.04's Python 3.12.3): every manylinux tag up to it runs there.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
]
MARKER_ENV = {
    "python_version": PYTHON,
    "python_full_version": f"{PYTHON}.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}
# plainrl's ranges that do not apply on the GPU machine: its own version stays, whatever the range says.
RELAXED = {
    "torch": "its CUDA build cannot travel; gpu_check.py checks the APIs plainrl calls",
    "numpy": "pyproject's <2.4 is for vLLM's mistral-common, and vLLM is not there",
}


def target_flags() -> list[str]:
    """pip's flags for wheels that install on the GPU machine."""
    flags = ["--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp"]
    return flags + [f for platform in PLATFORMS for f in ("--platform", platform)]


def read_lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def read_machine() -> dict[str, str | None]:
    """{name: version, or None where it was never read there}."""
    packages = {}
    for line in MACHINE_FILE.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            packages[canonicalize_name(name)] = version or None
    return packages


def plainrl_requirements() -> list[Requirement]:
    """pyproject's dependencies, torch's and numpy's ranges relaxed to the bare name."""
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    requirements = [Requirement(line) for line in listed]
    return [Requirement(r.name) if canonicalize_name(r.name) in RELAXED else r for r in requirements]


def wheels_in(folder: Path) -> dict[str, tuple[str, Path]]:
    """{name: (version, path)} of the wheels in `folder`."""
    found = {}
    for path in sorted(folder.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(path.name)
        found[canonicalize_name(name)] = (str(version), path)
    return found


def requires(wheel: Path, extras: set[str]) -> list[Requirement]:
    """The wheel's Requires-Dist that apply on the GPU machine with `extras` asked for."""
    with zipfile.ZipFile(wheel) as archive:
        metadata_name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(metadata_name).decode())
    applying = []
    for line in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        marker = requirement.marker
        if marker is None or any(marker.evaluate({**MARKER_ENV, "extra": e}) for e in ("", *extras)):
            applying.append(requirement)
    return applying


def download(specs: list[str], out: Path) -> None:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(out)]
    done = subprocess.run([*command, *target_flags(), *specs], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"pip download failed for {' '.join(specs)}:\n{done.stderr[-2000:]}")


def gather(out: Path) -> dict:
    """Walks plainrl's requirements, downloading what the machine lacks; returns what was decided."""
    lock, machine = read_lock(), read_machine()
    carried: dict[str, str] = {}  # name -> version
    extras: dict[str, set[str]] = {}
    asked: dict[str, list[str]] = {}  # name -> "spec (by whom)" for the report
    replaced: dict[str, str] = {}  # machine package -> why it is carried anyway
    queue = [(r, "plainrl") for r in plainrl_requirements()]
    while queue:
        to_walk = []
        for requirement, by in queue:
            name = canonicalize_name(requirement.name)
            asked.setdefault(name, []).append(f"{requirement.specifier or 'any'} ({by})")
            known = machine.get(name)
            if name in machine and name not in replaced and name not in RELAXED:
                if known is None or requirement.specifier.contains(known, prereleases=True):
                    continue  # the machine's own (unread versions are checked there by gpu_check.py)
                replaced[name] = f"{by} asks for {requirement.specifier}, the machine has {known}"
            elif name in RELAXED:
                continue
            if name not in lock:
                sys.exit(
                    f"{name} ({by} needs it on Python {PYTHON}) is not in requirements.lock: run `make lock`."
                )
            if not requirement.specifier.contains(lock[name], prereleases=True):
                sys.exit(f"{by} asks for {name}{requirement.specifier}, but the lock pins {lock[name]}.")
            new_extras = set(requirement.extras) - extras.get(name, set())
            if name not in carried or new_extras:
                carried[name] = lock[name]
                extras.setdefault(name, set()).update(requirement.extras)
                to_walk.append(name)
        present = wheels_in(out)
        missing = [f"{n}=={carried[n]}" for n in to_walk if present.get(n, (None,))[0] != carried[n]]
        if missing:
            download(missing, out)
        present = wheels_in(out)
        queue = [(r, n) for n in to_walk for r in requires(present[n][1], extras[n])]
    for name, (version, path) in wheels_in(out).items():
        if carried.get(name) != version:
            path.unlink()  # another lock's, or no longer needed: two versions would stop the install
    return {"carried": carried, "replaced": replaced, "asked": asked, "machine": machine, "lock": lock}


def stub_wheel(folder: Path, name: str, version: str) -> None:
    """A wheel that installs nothing and says `name` `version` is there, with no requirements."""
    stem = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as archive:
        archive.writestr(
            f"{stem}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        archive.writestr(
            f"{stem}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(f"{stem}.dist-info/RECORD", "")


def dry_run(out: Path, machine: dict[str, str | None], lock: dict[str, str]) -> dict:
    """pip's own resolution of plainrl's requirements from the folder and the machine's stubs."""
    with tempfile.TemporaryDirectory() as tmp:
        stubs, requirements = Path(tmp) / "stubs", Path(tmp) / "requirements.txt"
        stubs.mkdir()
        for name, version in machine.items():
            stub_wheel(stubs, name, version or lock.get(name, "0"))
        requirements.write_text("\n".join(str(r) for r in plainrl_requirements()) + "\n")
        report = Path(tmp) / "report.json"
        # pip takes a foreign platform only with --target; the dry run writes nothing there.
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--ignore-installed"]
        command += ["--target", str(Path(tmp) / "target")]
        command += ["--quiet", "--report", str(report), "--find-links", str(out), "--find-links", str(stubs)]
        # Only the two folders: the user's pip configuration (extra indexes, constraints) stays out.
        env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
        done = subprocess.run(
            [*command, *target_flags(), "-r", str(requirements)], capture_output=True, text=True, env=env
        )
        if done.returncode:
            sys.exit(f"the dry run does not resolve:\n{done.stderr[-3000:]}")
        installed = json.loads(report.read_text())["install"]
    resolved, from_machine = {}, []
    for item in installed:
        name = canonicalize_name(item["metadata"]["name"])
        resolved[name] = item["metadata"]["version"]
        if item["download_info"]["url"].startswith(stubs.as_uri()):
            from_machine.append(name)
    return {
        "resolved": resolved,
        "from_wheels": sorted(set(resolved) - set(from_machine)),
        "from_machine": sorted(from_machine),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-wheels", help="the wheel folder")
    parser.add_argument("--check-only", action="store_true", help="the dry run on the folder as it is")
    args = parser.parse_args()
    machine, lock = read_machine(), read_lock()
    if not args.check_only:
        claim_out(args.out, __file__, ("*.whl",), {"python": PYTHON})  # it removes the folder's stale wheels
        decided = gather(args.out)
        for name, why in sorted(decided["replaced"].items()):
            print(f"replaced: {name} carried at {lock[name]} ({why})")
        for name, why in RELAXED.items():
            print(f"kept: the machine's {name} ({machine[name]}): {why}")
    wheels = wheels_in(args.out)
    size = sum(path.stat().st_size for _, path in wheels.values())
    print(f"{args.out}: {len(wheels)} wheels, {size / 2**20:.1f} MiB")
    for name, (version, path) in sorted(wheels.items(), key=lambda item: -item[1][1].stat().st_size):
        print(f"  {path.stat().st_size / 2**20:6.2f} MiB  {name}=={version}")
    result = dry_run(args.out, machine, lock)
    unused = sorted(set(wheels) - set(result["resolved"]))
    kept = result["from_machine"]
    unread = [n for n in kept if machine[n] is None]
    print(
        f"dry run (pip install --dry-run --no-index, CPython {PYTHON}, manylinux x86-64): resolves "
        f"{len(result['resolved'])} packages, {len(result['from_wheels'])} from {args.out.name}/ and "
        f"{len(kept)} of the machine's own"
    )
    print(
        f"  the machine's, version read there: {', '.join(f'{n} {machine[n]}' for n in kept if machine[n])}"
    )
    print(
        f"  the machine's, version never read (stubbed at the lock's; gpu_check.py checks them there): {', '.join(unread)}"
    )
    if unused:
        sys.exit(f"wheels the resolution does not use: {', '.join(unused)}")
    if size > 64 * 2**20:
        sys.exit(f"{args.out} is {size / 2**20:.1f} MiB, over the 64 MiB that travels with a call.")


if __name__ == "__main__":
    main()
