#!/usr/bin/env bash
# On the GPU host: put the payload of build_payload.py together and install it (docs/gpu.md).
#
#   bash install.sh stash PART_DIR     a call that carries one part: copy it out of the repo (the next call's
#                                      tree replaces the repo's copy), check its sha256
#   bash install.sh install PART_DIR   the call that carries the last part: join every stashed part with this one,
#                                      check, untar, pip install --no-index --no-deps --target $SITE, unpack
#                                      src.tar.gz to $SRC, byte-compile vLLM; prints the line to source
#
# STASH (default /root/hs-gpu-stash), SITE (default /root/hs-gpu-site), SRC (default /root/hs-gpu-src).
# Exit 3: a part is missing (the host was recycled between calls: start again with the first part).
set -uo pipefail
cmd=${1:?stash|install}
PART=${2:?PART_DIR}
STASH=${STASH:-/root/hs-gpu-stash}
SITE=${SITE:-/root/hs-gpu-site}
SRC=${SRC:-/root/hs-gpu-src}
mkdir -p "$STASH"
manifest="$PART/payload.json"
sum_of() { python3 -c "import json,sys; print(json.load(open('$manifest'))['sha256'][sys.argv[1]])" "$1"; }
for f in "$PART"/payload.part*; do
    name=$(basename "$f")
    want=$(sum_of "$name")
    got=$(sha256sum "$f" | cut -d' ' -f1)
    [ "$want" = "$got" ] || { echo "install.sh: $name sha256 $got, expected $want" >&2; exit 2; }
    cp "$f" "$STASH/$name"
    echo "install.sh: $name ($(du -m "$f" | cut -f1) MiB) checked and stashed in $STASH"
done
[ "$cmd" = stash ] && exit 0
[ "$cmd" = install ] || { echo "usage: install.sh stash|install PART_DIR" >&2; exit 2; }
t0=$(date +%s)
parts=$(python3 -c "import json; print(json.load(open('$manifest'))['parts'])")
for ((i = 0; i < parts; i++)); do
    f="$STASH/payload.part$i"
    [ -f "$f" ] || { echo "install.sh: $f missing: the host was recycled; carry part $i again" >&2; exit 3; }
    [ "$(sha256sum "$f" | cut -d' ' -f1)" = "$(sum_of payload.part$i)" ] || { echo "install.sh: $f corrupt" >&2; exit 2; }
done
W=$(mktemp -d)
for ((i = 0; i < parts; i++)); do cat "$STASH/payload.part$i"; done | tar -x -C "$W" || exit 2
rm -rf "$SITE" "$SRC" && mkdir -p "$SITE" "$SRC"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$W"/payload/*.whl || exit 4
tar -xzf "$W/payload/src.tar.gz" -C "$SRC" --strip-components=1 || exit 2
python3 -m compileall -q -j 0 "$SITE/vllm" "$SITE/vllm_hs_compat" >/dev/null 2>&1
rm -rf "$W"
echo "install.sh: installed into $SITE, sources in $SRC, $(($(date +%s) - t0)) s"
echo "export PYTHONPATH=$SITE PATH=$SITE/bin:\$PATH"
