#!/usr/bin/env bash
# README's test command: set up everything, then lint and run every test tier that can run here
# (unit, integration against a real redis-server, e2e against a real control plane). Extra
# arguments go to pytest (e.g. scripts/test.sh -m "not e2e", or test paths outside e2e/, which also
# skip building the control plane, so they need no Go).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# The control plane (Go, e2e/cluster/build.sh) is set up unless pytest's -m expression deselects the
# e2e tier: the last -m wins, as in pytest, and it deselects e2e when it says `not e2e`.
cluster=--cluster
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    -m) marks="${args[i + 1]:-}" ;;
    -m*) marks="${args[i]#-m}" ;;
    *) continue ;;
  esac
  if [[ "$marks" =~ (^|[^[:alnum:]_])not[[:space:]]+e2e($|[^[:alnum:]_]) ]]; then cluster=--no-cluster; else cluster=--cluster; fi
done

# Test paths given, none of them in e2e/ (scripts/test.sh tests/unit/test_cli.py): no cluster either.
paths=0
e2e_path=0
for arg in "$@"; do
  [[ "$arg" == -* ]] && continue
  path="${arg%%::*}"  # a test id's file
  [[ "$path" == /* ]] || path="$repo/$path"  # pytest runs in the repo
  [[ -e "$path" ]] || continue
  paths=1
  case "$(realpath -m "$path")/" in "$repo/e2e/"* | "$repo/") e2e_path=1 ;; esac
done
if [[ $paths -eq 1 && $e2e_path -eq 0 ]]; then cluster=--no-cluster; fi

# Always an argument: `source` with none would hand setup.sh our own (pytest's) arguments.
source "$repo/scripts/setup.sh" "$cluster"
cd "$repo"
echo "== ruff check, ruff format --check"
ruff check .
ruff format --check .
echo "== pytest"
set +e
python -m pytest -p no:cacheprovider --timeout=900 "$@"
code=$?
set -e
if [[ $code -eq 5 ]]; then
  echo "no tests were collected: that is a failure" >&2
  exit 1
fi
exit $code
