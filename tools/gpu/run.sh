#!/usr/bin/env bash
# Runs tools/gpu/check.py on a GPU machine where superfluid is not installed and nothing can be
# installed (no network): the checkout is made importable as `superfluid` through a temporary
# folder of links, and the machine's own python3 (with torch) runs the check. The check needs
# torch, numpy, pluggy, attrs and psutil, nothing else. Arguments go to check.py.
#     set -o pipefail; bash tools/gpu/run.sh 2>&1 | tee check.md
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
mkdir "$site/superfluid"
ln -s "$PWD/core" "$site/superfluid/core"
ln -s "$PWD/plugins" "$site/superfluid/plugins"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c 'import torch; print(f"# torch {torch.__version__}, CUDA {torch.cuda.is_available()}")'
python3 tools/gpu/check.py "$@"
