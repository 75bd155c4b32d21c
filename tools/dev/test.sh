#!/usr/bin/env bash
# Set up (once) and run the whole test suite: unit tests plus real servers on loopback
# ports with the real default model. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bash tools/dev/setup.sh
exec .venv/bin/python -m pytest "$@"
