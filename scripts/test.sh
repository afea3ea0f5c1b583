#!/usr/bin/env bash
# The test command: install what is missing, build the native extension, run its `cargo test`,
# start the local stack (real Kafka, PostgreSQL, Redis, Prometheus, SeaweedFS), run the whole test suite, and stop the
# stack again if this script started it.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k router -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
UV="bash scripts/uv.sh"
bash scripts/sync.sh
# The native crate's own tests (its pure core: no Python needed to link them).
. scripts/cargo-env.sh
cargo test --quiet --manifest-path native/Cargo.toml
# The vLLM tier's environment (.venv-vllm): vLLM's CPU build here, CUDA vLLM with
# SWITCHYARD_VLLM_BUILD=cuda on GPU hosts. Its tests (marker `vllm`) run in the same session.
bash scripts/vllm-env.sh

was_running=$($UV run --frozen switchyard stack status --json | python3 -c \
  'import json,sys; print(int(any(s["running"] for s in json.load(sys.stdin))))')
stop_stack() {
  if [ "$was_running" = "0" ]; then $UV run --frozen switchyard stack down || true; fi
}
trap stop_stack EXIT

$UV run --frozen switchyard stack up
$UV run --frozen switchyard schemas check
# --durations: the slowest tests in every run's log, to keep the whole run inside CI's budget.
$UV run --frozen pytest -q -p no:cacheprovider --durations=25 "$@"
