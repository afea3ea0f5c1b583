#!/usr/bin/env bash
# Dynamo's planner environment: a separate venv (.venv-dynamo) holding ai-dynamo 1.6.1 (its
# planner and offline replay adapter) for `switchyard bench planner`. Benchmark-only: never a
# runtime dependency, never in pyproject.toml. Pinned in requirements/dynamo-planner.txt with
# requirements/dynamo-planner-overrides.txt; unchanged pin files are a no-op.
#
#   bash scripts/dynamo-planner-env.sh    # install/update (SWITCHYARD_DYNAMO_VENV=.venv-dynamo)
set -euo pipefail
cd "$(dirname "$0")/.."
UV="bash scripts/uv.sh"
VENV=${SWITCHYARD_DYNAMO_VENV:-.venv-dynamo}
REQ=requirements/dynamo-planner.txt
OVR=requirements/dynamo-planner-overrides.txt

want=$(cat "$REQ" "$OVR" | sha256sum | cut -d' ' -f1)
stamp="$VENV/.switchyard-pins"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
start=$(date +%s)
echo "dynamo-planner-env: installing $REQ into $VENV" >&2
$UV venv --quiet --allow-existing --python 3.11 "$VENV"
# ai-dynamo's pins are top-level only; the dev aisimulate needs --prerelease=allow.
$UV pip install --quiet --python "$VENV/bin/python" --prerelease=allow --override "$OVR" -r "$REQ"
"$VENV/bin/python" -c "import dynamo.planner.offline.replay_adapter"
echo "$want" > "$stamp"
echo "dynamo-planner-env: ready in $(( $(date +%s) - start ))s ($(du -sh "$VENV" | cut -f1))" >&2
