#!/usr/bin/env bash
# Set up (once) and serve the small default model (SmolLM2-135M-Instruct) on 127.0.0.1:8080.
# Extra arguments go to `superfluid serve` (see `superfluid serve --help`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bash tools/dev/setup.sh
exec .venv/bin/superfluid serve "$@"
