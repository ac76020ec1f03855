#!/usr/bin/env bash
# The weight store's GPU checks, as ONE call on a lent GPU machine (issue 4 leaves them open):
#   here, once:   bash scripts/device_prepare.sh
#   then:         run(command="bash scripts/device_checks.sh", carry=[".whl", ".device"], timeout_s=560)
# About 6 minutes on an H200 machine by its 16 cores (an estimate: not yet run there). Results come
# back from $OUT: log.txt (everything printed), weight_pass.json, and bench_weight_delta's JSON and
# PNG for the GPU run and for the same machine's CPU run. The model file cannot travel (538 MB), so
# both use SmolLM2's shapes with a seeded random init (`--weights random`); sizes and speeds are
# comparable with docs/results, values are not the real model's.
# Locally, to check the script itself: RLJOB_DEVICE=cpu PYTHON=$HOME/.cache/rljob/venv/bin/python OUT=/tmp/out bash scripts/device_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rljob-device-out}
PY=${PYTHON:-python3}
DEVICE=${RLJOB_DEVICE:-cuda}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1

if ! "$PY" -c "import pydantic, redis, zlib_ng" 2>/dev/null; then  # the GPU machine's image lacks these
  [ -d .whl ] || { echo "pydantic/redis/zlib-ng missing and no .whl: run scripts/device_prepare.sh here first"; exit 1; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/workers:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}"
[ -d .device/bin ] && export PATH="$PWD/.device/bin:$PATH"
command -v redis-server >/dev/null || { echo "no redis-server: run scripts/device_prepare.sh here first"; exit 1; }

status=0
step() { echo; echo "=== $* ($(date +%T))"; "$@" || { echo "=== FAILED: $*"; status=1; }; }

step nvidia-smi -L
step "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
# The store's unit tests, including the device-memory apply path, on this machine.
step "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_weight_codec.py tests/unit/test_weight_stream.py \
  tests/unit/test_weight_parallel.py
step "$PY" benchmarks/bench_weight_pass.py --weights random --results "$OUT"
step "$PY" benchmarks/bench_weight_delta.py --weights random --device "$DEVICE" --out "$OUT/weight_delta_$DEVICE"
if [ "$DEVICE" != cpu ]; then  # the same machine's CPUs, for a like-for-like baseline
  step "$PY" benchmarks/bench_weight_delta.py --weights random --device cpu --out "$OUT/weight_delta_cpu"
fi
echo; echo "=== done ($(date +%T)), status $status"
exit $status
