#!/usr/bin/env bash
# The whole system on one box: install what is missing, start the stack and every Switchyard
# process, replay a slice of the Mooncake trace through the router, print a summary and a PNG
# report. Extra arguments go to `switchyard up` (e.g. --limit 500 --rate 10 --stop).
# `bash scripts/uv.sh run switchyard down` stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/sync.sh
exec bash scripts/uv.sh run --frozen switchyard up --demo "$@"
