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

# The non-CUDA wheel's engine.so and store.so link libibverbs.so.1 even when only TCP is used.  It is unpacked
# into the venv (sysroot/, put on LD_LIBRARY_PATH for Mooncake's processes only), never installed system-wide:
# a system libibverbs makes the NIXL wheel's UCX load its InfiniBand module, whose bundled libnl then crashes
# every process with a NIXL agent at exit (SIGSEGV in rtnl_tc_unregister).
mkdir -p "$VENV/sysroot"
if ! ls "$VENV"/sysroot/usr/lib/*/libibverbs.so.1 >/dev/null 2>&1; then
  debs=$(mktemp -d)
  (cd "$debs" && apt-get download libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null) || {
    echo "Mooncake needs libibverbs.so.1: 'apt-get update' then rerun (packages are unpacked, not installed)" >&2
    exit 1
  }
  for d in "$debs"/*.deb; do dpkg -x "$d" "$VENV/sysroot"; done
  rm -rf "$debs"
fi
"$BASE_PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "mooncake-transfer-engine-non-cuda==$VERSION"
base_site=$("$BASE_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
venv_site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$base_site" > "$venv_site/zz_base_env.pth"

LD_LIBRARY_PATH=$(echo "$VENV"/sysroot/usr/lib/*-linux-gnu "$VENV"/sysroot/lib/*-linux-gnu | tr ' ' :) "$VENV/bin/python" -c 'from mooncake.engine import TransferEngine; from mooncake.store import MooncakeDistributedStore; import torch, xxhash'
test -x "$VENV/bin/mooncake_master"
echo "Mooncake $VERSION installed in $VENV (run: $BASE_PY benchmarks/bench_vs_mooncake.py --mooncake-python $VENV/bin/python)"
