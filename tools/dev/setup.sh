#!/usr/bin/env bash
# Creates .venv (Python 3.11+) and installs superfluid with its test extras, once.
# llama-cpp-python compiles llama.cpp from source on first install (about 10 minutes on
# 2 cores); pip caches the built wheel, so later installs take seconds. Re-running is
# cheap: nothing is reinstalled unless pyproject.toml, setup.py or the C decode loop changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
    for cand in python3.11 python3.12 python3.13 python3; do
        if command -v "$cand" >/dev/null && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
            PY="$cand"; break
        fi
    done
fi
[[ -n "$PY" ]] || { echo "setup: Python 3.11 or newer is required" >&2; exit 1; }
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
stamp=.venv/.superfluid-installed
want="$(cat pyproject.toml setup.py plugins/llamacpp/_rounds.c examples/*/pyproject.toml | sha256sum | cut -d' ' -f1)"
# pip's own output (setuptools' notes on editable installs, this machine's pip configuration) goes
# to a log that is shown only if a step fails: a newcomer's set-up prints the lines below and no more.
log=.venv/install.log
pip_install() {
    if ! .venv/bin/python -m pip install --quiet "$@" >>"$log" 2>&1; then
        echo "setup: pip install $* failed; the last lines of $log:" >&2
        tail -n 40 "$log" >&2
        exit 1
    fi
}
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]] || ! .venv/bin/python -c 'import superfluid.core, llama_cpp' 2>/dev/null; then
    echo "setup: installing superfluid into .venv (the first time compiles llama.cpp: ~10 minutes; pip's log: $log)" >&2
    : > "$log"
    pip_install --upgrade pip
    # basert's PyTorch first, pinned: an unpinned torch (or a range admitting a newer release)
    # pulls a CUDA build of several GB; 2.13.0 is the CPU build this machine's index serves
    pip_install "torch==2.13.0"
    pip_install -e ".[dev,mlx,mlx-vlm,suite,basert,fleet]"
    # the plugin kit's examples, installed as a third party would install them (entry points)
    pip_install -e examples/fair-share -e examples/echo-engine
    echo "$want" > "$stamp"
    echo "setup: superfluid installed" >&2
fi
# The dashboard's browser test drives Debian's Chromium (playwright with executable_path).
if ! command -v chromium >/dev/null && [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
    echo "setup: installing Debian's chromium for the dashboard's browser test" >&2
    if ! apt-get install -y -q chromium >/dev/null 2>&1; then
        apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1 || \
            echo "setup: chromium could not be installed; the dashboard's browser test will fail (SUPERFLUID_SKIP_BROWSER=1 skips it)" >&2
    fi
fi
