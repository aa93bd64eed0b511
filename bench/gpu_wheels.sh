#!/usr/bin/env bash
# The Python packages a lent GPU machine lacks (it has torch, triton, transformers, pytest, xdist; no network),
# as cp312 wheels in .whl/ for bench/gpu_check.sh: gguf, llguidance, jsonschema and its three, redis, and NIXL.
# nixl_cu13's wheel is 59 MB (237 MB unpacked) with the expert-parallel package and storage plugins; trimmed to
# the UCX and POSIX plugins (~17 MB) so that it travels within the device tool's 64 MiB. Run here, not there.
set -euo pipefail
dest=${1:-.whl}
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/.whl/" >> .git/info/exclude; }
plat=(--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${plat[@]}" -d "$dest" "$@"; }
get gguf==0.19.0 llguidance==1.9.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
    rpds-py==2026.9.1 redis==8.1.0 nixl==1.5.1 nixl-cu13==1.5.1

wheel=$(ls "$dest"/nixl_cu13-1.5.1-*.whl)
work=$(mktemp -d)
(cd "$work" && unzip -q "$wheel")
rm -rf "$work/nixl_ep_cu13" "$work/.nixl_cu13.mesonpy.libs/libobj_utils.so"
for d in nixl_cu13.libs/nixl .nixl_cu13.mesonpy.libs/plugins; do
    find "$work/$d" -maxdepth 1 -type f ! -name '*UCX*' ! -name '*POSIX*' -delete
done
rm -f "$work"/nixl_cu13.libs/{libaws,libazure,libs2n,libxml2}* "$work"/nixl_cu13.libs/ucx/libucx_perftest*
rm "$wheel"
(cd "$work" && zip -q -9 -r "$wheel" .)
rm -rf "$work"
du -sh "$dest"
