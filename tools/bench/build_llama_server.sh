#!/usr/bin/env bash
# Build llama.cpp's own llama-server from the llama.cpp source that the
# llama-cpp-python sdist vendors, so the baseline and superfluid's llama.cpp
# adapter run the very same runtime build (spec/benchmarks.md: "same machine,
# model and runtime build").
#
# Usage: tools/bench/build_llama_server.sh
# Env:   LLAMA_CPP_PYTHON_VERSION (default 0.3.36)
#        SUPERFLUID_CACHE         (default $HOME/.cache/superfluid)
#        LLAMA_SERVER_SRC         (default $SUPERFLUID_CACHE/llama-server-src)
#        PYTHON                   (default: the repo's .venv python, else python3)
#        JOBS                     (default 2)
# Prints the path of the llama-server binary on its last line. Idempotent: a
# binary already built is reused without rebuilding.
# LLAMA_CURL is deprecated in this llama.cpp (a configure warning only); the
# UI is not fetched (LLAMA_USE_PREBUILT_UI=OFF) and not built with npm
# (LLAMA_BUILD_UI defaults OFF), so the build needs no network after the sdist.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${SUPERFLUID_CACHE:-$HOME/.cache/superfluid}"
WORK="${LLAMA_SERVER_SRC:-$CACHE/llama-server-src}"
JOBS="${JOBS:-2}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then
        PYTHON="$REPO_ROOT/.venv/bin/python"
    else
        PYTHON=python3
    fi
fi

SRC="$WORK/llama_cpp_python-$VERSION"
BUILD="$SRC/build-llama-server"
BIN="$BUILD/bin/llama-server"

if [[ -x "$BIN" ]]; then
    echo "llama-server already built" >&2
    echo "$BIN"
    exit 0
fi

mkdir -p "$WORK"

# 1. The sdist, source only (never a wheel: a wheel has no vendor/ tree).
SDIST="$(ls "$WORK"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
if [[ -z "$SDIST" ]]; then
    echo "downloading llama-cpp-python==$VERSION sdist into $WORK" >&2
    "$PYTHON" -m pip download --no-deps --no-binary :all: \
        --dest "$WORK" "llama-cpp-python==$VERSION" >&2
    SDIST="$(ls "$WORK"/llama_cpp_python-"$VERSION".tar.gz)"
fi

# 2. Extract (once).
if [[ ! -d "$SRC/vendor/llama.cpp" ]]; then
    echo "extracting $SDIST" >&2
    tar -xzf "$SDIST" -C "$WORK"
fi
LLAMA="$SRC/vendor/llama.cpp"
[[ -f "$LLAMA/CMakeLists.txt" ]] || { echo "no vendor/llama.cpp in $SDIST" >&2; exit 1; }
[[ -d "$LLAMA/tools/server" ]] || { echo "vendor/llama.cpp has no tools/server" >&2; exit 1; }

# 3. Configure and build only the server target.
GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
    cmake -S "$LLAMA" -B "$BUILD" "${GEN[@]}" \
        -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_SERVER=ON >&2
fi
cmake --build "$BUILD" --target llama-server -j"$JOBS" >&2

[[ -x "$BIN" ]] || { echo "build finished but $BIN is missing" >&2; exit 1; }
echo "$BIN"
