#!/bin/sh
# The fleet head without Docker, on a Mac or any box (once, from a checkout:
# python3 -m venv ~/superfluid && ~/superfluid/bin/pip install '.[fleet]'):
# SMG routes to the nodes that head/nodes.json lists and that answer /health.
#   sh fleet-head.sh                       # nodes from head/nodes.json, reread when it changes
#   sh fleet-head.sh --policy round_robin  # extra flags go to `superfluid fleet`
set -eu
SUPERFLUID=${SUPERFLUID:-$HOME/superfluid/bin/superfluid}
cd "$(dirname "$0")"
exec "$SUPERFLUID" fleet --discovery-file head/nodes.json --policy cache_aware \
    --host 0.0.0.0 --port "${PORT:-8080}" "$@"
