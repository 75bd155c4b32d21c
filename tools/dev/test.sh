#!/usr/bin/env bash
# Set up (once) and run the whole test suite: unit tests plus real servers on loopback
# ports with the real default model. Extra arguments go to pytest.
#
# With no test path among the arguments it runs in three parts: the unit, docs and packaging tests
# on every core (pytest-xdist: they are independent and most are pure Python, so each core takes
# a share); the server modules marked two_at_a_time, two modules at once (their assertions read no
# timings, and most of their work runs on one core: MLX, torch's imports, transformers' references,
# so one alone leaves a core idle); then the other server tests one at a time (each starts real
# servers whose timings and memory its assertions read; two at once would measure each other).
# With a path it runs pytest once on what it names.
#
# It ends with the 15 slowest tests and their kind (tools/dev/suite_costs.py: server start,
# waiting, real work), then the set-up's and the tests' wall times and the CPU, so every change
# sees what it costs the suite (docs/development.md: the time budget).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
start=$(date +%s)
bash tools/dev/setup.sh
setup_done=$(date +%s)
# each test's phases and kind, kept after the run (git-ignored): python -m tools.dev.suite_costs
# --top 30 test-artifacts/suite-costs/*.json lists more than the 15 printed below
costs=test-artifacts/suite-costs
rm -rf "$costs" && mkdir -p "$costs"
pytest=(.venv/bin/python -m pytest -p tools.dev.suite_costs --costs-top 0)
named_path=0
for arg in "$@"; do
    [[ "$arg" != -* && -e "${arg%%::*}" ]] && named_path=1
done
status=0
if (( named_path )); then
    "${pytest[@]}" --costs-file "$costs/all.json" "$@" || status=$?
else
    "${pytest[@]}" --costs-file "$costs/unit.json" -n auto tests/unit tests/test_docs.py tests/test_packaging.py "$@" \
        || status=$?
    mapfile -t paired < <(grep -l "pytest.mark.two_at_a_time" tests/server/test_*.py)
    "${pytest[@]}" --costs-file "$costs/server-paired.json" -n 2 --dist loadfile "${paired[@]}" "$@" || status=$?
    "${pytest[@]}" --costs-file "$costs/server.json" tests/server "${paired[@]/#/--ignore=}" "$@" || status=$?
fi
end=$(date +%s)
.venv/bin/python -m tools.dev.suite_costs --top 15 "$costs"/*.json || true
echo "wall time: set-up $((setup_done - start)) s, tests $((end - setup_done)) s, total $((end - start)) s" \
     "($(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//' || uname -m))"
exit $status
