#!/usr/bin/env bash
# Run HERE (not on the GPU machine) before a `run` of scripts/device_checks.sh: the GPU machine
# reaches nothing, has Python 3.12 with torch, numpy, safetensors, transformers and pytest, and
# lacks the rest of what the weight store imports (pydantic, redis, zlib-ng) and a redis-server.
# This puts wheels for those in .whl/ and a redis-server with the shared libraries it needs in
# .device/ (both ignored by git through .git/info/exclude, both small: about 17 MB), for the
# call's `carry: [".whl", ".device"]`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${RLJOB_VENV:-$HOME/.cache/rljob/venv}
PY="$VENV/bin/python"

for path in /.whl/ /.device/; do
  grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude
done

# The same versions as this venv, built for the GPU machine's CPython 3.12 on manylinux x86-64.
rm -rf .whl && mkdir -p .whl
pins=$("$PY" -m pip list --format=freeze 2>/dev/null \
  | grep -iE '^(pydantic|pydantic[-_]core|annotated[-_]types|typing[-_]inspection|redis|zlib[-_]ng)==' )
echo "wheels: $(echo $pins)"
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl $pins

# redis-server behind a wrapper that points the loader at the libraries carried beside it (only
# for that process), so it runs whatever the GPU machine's image holds.
rm -rf .device && mkdir -p .device/bin .device/redis/lib
server=$(command -v redis-server) || { echo "redis-server not found: run scripts/setup.sh first" >&2; exit 1; }
cp "$server" .device/redis/redis-server
ldd "$server" | awk '/=> \// {print $3}' | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|ld-linux*) ;;  # glibc: the machine's own
    *) cp -L "$lib" .device/redis/lib/ ;;
  esac
done
cat > .device/bin/redis-server <<'WRAP'
#!/usr/bin/env bash
here="$(cd "$(dirname "$0")/../redis" && pwd)"
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/redis-server" "$@"
WRAP
chmod +x .device/bin/redis-server
.device/bin/redis-server --version
du -sh .whl .device
