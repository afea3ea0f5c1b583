#!/usr/bin/env bash
# Run uv whether it is on PATH or only installed as a module of this python3.
if command -v uv >/dev/null; then exec uv "$@"; else exec python3 -m uv "$@"; fi
