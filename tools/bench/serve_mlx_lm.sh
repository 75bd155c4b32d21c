#!/usr/bin/env bash
# Serves a GGUF through mlx-lm's own server (mlx_lm.server), the MLX baseline of the bench:
#   tools/bench/serve_mlx_lm.sh MODEL.gguf PORT
# The GGUF is first written as an mlx-lm directory (same quantized weights, see
# superfluid.plugins.mlx.convert) next to it, once. mlx_lm.server's /v1/models lists the
# Hugging Face cache, so HF_HUB_CACHE must name an existing directory; no hub is contacted.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
gguf="${1:?usage: serve_mlx_lm.sh MODEL.gguf PORT}"
port="${2:?usage: serve_mlx_lm.sh MODEL.gguf PORT}"
dir="${MLX_DIR:-${gguf%.gguf}-mlx}"
[[ -f "$dir/config.json" ]] || .venv/bin/python -m superfluid.plugins.mlx.convert "$gguf" "$dir" >&2
export HF_HUB_CACHE="${HF_HUB_CACHE:-$dir/.hf-cache}" HF_HUB_OFFLINE=1
mkdir -p "$HF_HUB_CACHE"
exec .venv/bin/python -m mlx_lm.server --model "$dir" --host 127.0.0.1 --port "$port"
