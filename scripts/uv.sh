#!/usr/bin/env bash
# Run uv whether it is on PATH or only installed as a module of this python3. `uv sync` builds
# the native extension (native/) from source with maturin, which needs cargo on PATH.
. "$(dirname "$0")/cargo-env.sh"
if command -v uv >/dev/null; then exec uv "$@"; else exec python3 -m uv "$@"; fi
