#!/usr/bin/env bash
# Dynamo's planner environment: a separate venv (.venv-dynamo) holding ai-dynamo 1.6.1 (its
# planner and offline replay adapter) for `switchyard bench planner`. Benchmark-only: never a
# runtime dependency, never in pyproject.toml. Pinned in requirements/dynamo-planner.txt with
# requirements/dynamo-planner-overrides.txt; unchanged pin files are a no-op.
#
#   bash scripts/dynamo-planner-env.sh    # install/update (SWITCHYARD_DYNAMO_VENV=.venv-dynamo)
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/pinned-env.sh dynamo-planner-env "${SWITCHYARD_DYNAMO_VENV:-.venv-dynamo}" \
  requirements/dynamo-planner.txt requirements/dynamo-planner-overrides.txt \
  '"$VENV/bin/python" -c "import dynamo.planner.offline.replay_adapter"'
