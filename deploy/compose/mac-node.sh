#!/bin/sh
# A superfluid node on a Mac, native (MLX runs on Apple silicon's GPU; not in a container).
# Once, from a checkout of superfluid:
#         python3 -m venv ~/superfluid && ~/superfluid/bin/pip install '.[mlx]'
# Then:   sh mac-node.sh                                  # the default model (SmolLM2 GGUF) on MLX
#         MODEL=~/models/Qwen3-4B-4bit sh mac-node.sh     # an mlx-lm model directory (docs/mlx.md)
# The same keys.toml as every other box (KEYS=path); the head's head/nodes.json lists
# http://THIS-MAC:8000. Extra flags go to `superfluid serve`.
set -eu
SUPERFLUID=${SUPERFLUID:-$HOME/superfluid/bin/superfluid}
KEYS=${KEYS:-keys.toml}
PORT=${PORT:-8000}
if [ -n "${MODEL:-}" ]; then
    set -- --model "$MODEL" "$@"
fi
exec "$SUPERFLUID" serve --engine mlx --host 0.0.0.0 --port "$PORT" --model-name smollm2 \
    --max-batch 8 --key-policy "$KEYS" --http-open-probes "$@"
