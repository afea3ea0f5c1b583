#!/usr/bin/env bash
# The project's environment (.venv) from uv.lock, native extension included, with every module
# compiled to bytecode: installed packages by uv (pyproject's compile-bytecode), the project's own
# sources here, because PYTHONDONTWRITEBYTECODE (set in CI) stops Python from caching them, and
# each of the system's processes would compile them again at start-up.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/uv.sh sync --frozen --quiet
.venv/bin/python -m compileall -q -j 0 control_plane data_plane kernel schemas switchyard benchmarks tests >/dev/null
