# Sourced by the scripts that build native/: puts cargo on PATH when it is installed but not
# there (rustup installs into ${CARGO_HOME:-~/.cargo}/bin and only edits login shells' PATH).
if ! command -v cargo >/dev/null 2>&1; then
  for _d in "${CARGO_HOME:-$HOME/.cargo}/bin" /root/.cargo/bin /usr/local/cargo/bin; do
    if [ -x "$_d/cargo" ]; then export PATH="$_d:$PATH"; break; fi
  done
  unset _d
fi
