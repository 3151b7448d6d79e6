#!/usr/bin/env bash
# The CI entry: installs what the checks need on a fresh machine, then runs the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS

# flake.nix syntax, checked with the Nix evaluator from Debian's nix-bin.
if ! command -v nix-instantiate >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nix-bin >/dev/null
fi
nix-instantiate --parse flake.nix >/dev/null && echo "flake.nix parses"

# A real SLURM for tests/test_slurm.py, which starts its own munged, slurmctld and two slurmd (Debian's
# slurm-wlm 22.05; the packages' own services are not used).
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge >/dev/null
fi

make test
echo "ci: done in $((SECONDS - start)) s"
