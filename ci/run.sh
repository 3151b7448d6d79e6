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

make test
echo "ci: done in $((SECONDS - start)) s"
