#!/usr/bin/env bash
# Builds llama-server from the llama.cpp that llama-cpp-python 0.3.36 vendors (its PyPI
# sdist), CPU only, into a cache directory, and keeps that llama.cpp's Python side
# (convert_hf_to_gguf.py, convert_lora_to_gguf.py, conversion/, gguf-py/) beside it for
# the collect fixture (scripts/collect_fixture.py). Prints the cache directory on its
# last line. Does nothing but print it when the cache is complete.
#
#   scripts/build-llama-server.sh [CACHE_ROOT]   (default ~/.cache/loraq-ci)
#
# Result: CACHE_ROOT/llama-server-0.3.36/bin/llama-server and
#         CACHE_ROOT/llama-server-0.3.36/llama.cpp/{convert_*.py,conversion,gguf-py}.
# About 10-13 minutes on 2 cores the first time (docs/collect.md).
set -euo pipefail

VERSION=0.3.36
ROOT="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/loraq-ci}"
DEST="$ROOT/llama-server-$VERSION"
JOBS="${LORAQ_BUILD_JOBS:-$(nproc)}"

if [[ -x "$DEST/bin/llama-server" && -f "$DEST/llama.cpp/convert_hf_to_gguf.py" && -f "$DEST/complete" ]]; then
    echo "$DEST"
    exit 0
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/loraq-llama-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$ROOT"

# cmake and ninja from PyPI (the machine may have neither); scikit-build-core so that
# `pip download` can read the sdist's metadata without building its build dependencies
# (cmake among them) from source.
TOOLS="$ROOT/llama-build-tools-venv"
if [[ ! -x "$TOOLS/bin/cmake" ]]; then
    python3 -m venv "$TOOLS"
    "$TOOLS/bin/pip" install --quiet --disable-pip-version-check cmake ninja scikit-build-core
fi
"$TOOLS/bin/pip" download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
    --no-build-isolation "llama-cpp-python==$VERSION" -d "$WORK" >&2
tar -xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"

# CPU only, portable code (no -march=native: the cache may move to another CI machine),
# no network at build time (no OpenSSL, no prebuilt web UI download), static libraries
# so the binary stands alone in the cache.
PATH="$TOOLS/bin:$PATH" cmake -S "$SRC" -B "$WORK/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF \
    -DGGML_OPENMP=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_SERVER=ON >&2
PATH="$TOOLS/bin:$PATH" nice cmake --build "$WORK/build" --target llama-server -j "$JOBS" >&2

STAGE="$ROOT/.llama-server-$VERSION.partial"
rm -rf "$STAGE"
mkdir -p "$STAGE/bin" "$STAGE/llama.cpp"
cp "$WORK/build/bin/llama-server" "$STAGE/bin/"
cp -r "$SRC/convert_hf_to_gguf.py" "$SRC/convert_lora_to_gguf.py" "$SRC/conversion" \
    "$SRC/gguf-py" "$SRC/LICENSE" "$STAGE/llama.cpp/"
"$STAGE/bin/llama-server" --version >&2
touch "$STAGE/complete"
rm -rf "$DEST"
mv "$STAGE" "$DEST"
echo "$DEST"
