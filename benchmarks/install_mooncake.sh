#!/usr/bin/env bash
# Mooncake for benchmarks/bench_vs_mooncake.py only: installed into its own virtual environment (.venv-mooncake,
# gitignored), never a dependency of the package.  The venv also sees the project environment's packages (torch,
# nixl, xxhash, ...) through a .pth file, after its own.
#
#   bash benchmarks/install_mooncake.sh                 # BASE_PY=/work/devenv/bin/python if present, else python3
#   BASE_PY=/path/to/python VENV=/tmp/mc bash benchmarks/install_mooncake.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${BASE_PY:-}" ]; then
  if [ -x /work/devenv/bin/python ]; then BASE_PY=/work/devenv/bin/python; else BASE_PY=python3; fi
fi
VENV=${VENV:-$ROOT/.venv-mooncake}
VERSION=${MOONCAKE_VERSION:-0.3.13.post1}

# The non-CUDA wheel's engine.so and store.so link libibverbs.so.1 even when only TCP is used.
if ! ldconfig -p | grep -q 'libibverbs\.so\.1 '; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq libibverbs1
  else
    echo "Mooncake needs libibverbs.so.1: install it (Debian/Ubuntu: apt-get install libibverbs1), then rerun" >&2
    exit 1
  fi
fi

"$BASE_PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "mooncake-transfer-engine-non-cuda==$VERSION"
base_site=$("$BASE_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
venv_site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$base_site" > "$venv_site/zz_base_env.pth"

"$VENV/bin/python" -c 'from mooncake.engine import TransferEngine; from mooncake.store import MooncakeDistributedStore; import torch, xxhash'
test -x "$VENV/bin/mooncake_master"
echo "Mooncake $VERSION installed in $VENV (run: $BASE_PY benchmarks/bench_vs_mooncake.py --mooncake-python $VENV/bin/python)"
