#!/usr/bin/env bash
# README's test command: set up everything, then lint and run every test tier that can run here
# (unit, integration against a real redis-server, e2e against a real control plane). Extra
# arguments go to pytest (e.g. scripts/test.sh -m "not e2e").
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/setup.sh" --cluster
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
