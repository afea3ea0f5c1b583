#!/usr/bin/env bash
# The peer routers' environment: a separate venv (.venv-peers) holding smg 1.13.0,
# sglang-router 0.3.2, vllm-router 0.1.17 and Dynamo 1.6.1 (its frontend and mocker) for
# `switchyard bench peers`. Benchmark-only: never a runtime dependency, never in pyproject.toml.
# Pinned in requirements/peers.txt; ai-dynamo's aisimulate comes from the override the planner's
# environment uses (requirements/dynamo-planner-overrides.txt). Unchanged pin files are a no-op.
#
#   bash scripts/peers-env.sh    # install/update (SWITCHYARD_PEERS_VENV=.venv-peers)
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/pinned-env.sh peers-env "${SWITCHYARD_PEERS_VENV:-.venv-peers}" \
  requirements/peers.txt requirements/dynamo-planner-overrides.txt \
  'for exe in smg sglang-router vllm-router; do test -x "$VENV/bin/$exe" || { echo "$VENV/bin/$exe missing" >&2; exit 1; }; done
   "$VENV/bin/python" -c "import dynamo.frontend, dynamo.mocker"'
