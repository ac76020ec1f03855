#!/usr/bin/env bash
# README's main command: set up, then run the demo RLJob on this machine (embedded Redis, the
# bundled SmolLM2-135M-Instruct, the HotpotQA sample) and print EM/F1 before and after training.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/setup.sh"
cd "$repo"
exec rljob run "${1:-examples/rljob-local.yaml}" --local "${@:2}"
