#!/usr/bin/env bash
# Regenerates requirements.lock (CPU-installable core + dev tools) and requirements-vllm.lock
# (the same pins plus vllm) from pyproject.toml. Resolving uses uv; installing uses pip.
# The core lock leaves out torch's CUDA wheels (nvidia-*, cuda-*, triton): pip fetches the
# ones a machine needs when it installs torch==2.13.0, and CPU machines need none.
set -euo pipefail
cd "$(dirname "$0")/.."
UV="${UV:-uv}"
common=(--python-version 3.11 --no-header --quiet)
"$UV" pip compile pyproject.toml --extra dev "${common[@]}" -o requirements.lock
skip=()
for name in $(grep -oE '^(nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+|triton)==' requirements.lock | tr -d '='); do
    skip+=(--no-emit-package "$name")
done
"$UV" pip compile pyproject.toml --extra dev "${common[@]}" "${skip[@]}" -o requirements.lock
# The vLLM lock is constrained by the core lock, so every shared package has the same pin.
"$UV" pip compile pyproject.toml --extra dev --extra vllm "${common[@]}" -c requirements.lock \
    -o requirements-vllm.lock
echo "wrote requirements.lock ($(grep -c '==' requirements.lock) pins) and requirements-vllm.lock ($(grep -c '==' requirements-vllm.lock) pins)"
