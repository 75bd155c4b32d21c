#!/usr/bin/env bash
# Set up (once) and run the whole test suite: unit tests plus real servers on loopback
# ports with the real default model. Extra arguments go to pytest.
# It prints the 15 slowest tests (--durations) and the set-up's and the tests' wall times, so
# every change sees what it costs the suite (docs/development.md: the time budget).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
start=$(date +%s)
bash tools/dev/setup.sh
setup_done=$(date +%s)
status=0
.venv/bin/python -m pytest --durations=15 "$@" || status=$?
end=$(date +%s)
echo "wall time: set-up $((setup_done - start)) s, tests $((end - setup_done)) s, total $((end - start)) s" \
     "($(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//' || uname -m))"
exit $status
