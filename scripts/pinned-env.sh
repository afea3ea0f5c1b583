#!/usr/bin/env bash
# A benchmark-only venv from pin files, rebuilt only when the pins change (a stamp in the venv
# holds their digest). Used by scripts/dynamo-planner-env.sh and scripts/peers-env.sh.
#
#   bash scripts/pinned-env.sh NAME VENV REQUIREMENTS OVERRIDES CHECK_COMMAND
#
# CHECK_COMMAND runs in the repo root with $VENV set (e.g. '"$VENV/bin/python" -c "import x"');
# the stamp is written only after it passes.
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=$1 VENV=$2 REQ=$3 OVR=$4 CHECK=$5
UV="bash scripts/uv.sh"

want=$(cat "$REQ" "$OVR" | sha256sum | cut -d' ' -f1)
stamp="$VENV/.switchyard-pins"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
start=$(date +%s)
echo "$NAME: installing $REQ into $VENV" >&2
$UV venv --quiet --allow-existing --python 3.11 "$VENV"
# ai-dynamo's pins are top-level only; the dev aisimulate (in the overrides) needs --prerelease=allow.
$UV pip install --quiet --python "$VENV/bin/python" --prerelease=allow --override "$OVR" -r "$REQ"
VENV="$VENV" bash -c "$CHECK"
echo "$want" > "$stamp"
echo "$NAME: ready in $(( $(date +%s) - start ))s ($(du -sh "$VENV" | cut -f1))" >&2
