#!/usr/bin/env bash
# Builds llama.cpp once, from the source inside the llama-cpp-python sdist (PyPI), into .cache/llama.cpp:
# llama-bench, llama-server, llama-quantize. Native CPU flags (GGML_NATIVE), Release, static, no curl.
# Re-running is a no-op once the three binaries exist and were built with these flags (build/.duet-flags).
# LLAMACPP_VERSION pins the sdist.
#
# AMX off (-mno-amx-*; every other native flag kept): with it, ggml's AMX matmul segfaults here on every batch
# of more than one token (ggml_backend_amx_mul_mat, in llama-server's start-up warm-up and in llama-bench -p 64;
# batch-1 decode does not reach it), on the 2-vCPU Sapphire Rapids KVM dev box, llama-cpp-python 0.3.36's
# llama.cpp: the crash of llama.cpp issue #20824 (closed stale, unfixed).
set -euo pipefail
DEST=${LLAMACPP_DIR:-.cache/llama.cpp}
VERSION=${LLAMACPP_VERSION:-0.3.36}
PIP=${PIP:-.venv/bin/pip}
FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
BIN="$DEST/build/bin"
STAMP="$DEST/build/.duet-flags"
if [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-quantize" ] && \
   [ "$(cat "$STAMP" 2>/dev/null)" = "$VERSION $FLAGS" ]; then
  echo "llama.cpp: $BIN (built)"; exit 0
fi
for tool in cmake ninja; do
  command -v "$tool" >/dev/null || { echo "llama.cpp build needs $tool (apt-get install cmake ninja-build)" >&2; exit 2; }
done
mkdir -p "$DEST"
if [ ! -d "$DEST/src" ]; then
  tmp=$(mktemp -d)
  "$PIP" download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$tmp"
  tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$DEST/src"
  rm -rf "$tmp"
fi
cmake -S "$DEST/src" -B "$DEST/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DCMAKE_C_FLAGS="$FLAGS" -DCMAKE_CXX_FLAGS="$FLAGS" \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
cmake --build "$DEST/build" -j "$(nproc)" --target llama-bench llama-server llama-quantize
echo "$VERSION $FLAGS" > "$STAMP"
echo "llama.cpp: $BIN"
