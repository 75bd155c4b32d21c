"""Throughput / TTFT / stream-smoothness benchmark following the method of spec/benchmarks.md.

Runs against any OpenAI-compatible server by URL, so superfluid and a runtime's own
server (llama-server, mlx_lm.server) are measured by the same client code:

    python -m tools.bench --target superfluid=http://127.0.0.1:8080 \\
                          --target llama-server=http://127.0.0.1:8081

or starts the servers itself from one GGUF (``NAME=KIND:MODEL.gguf``, see launch.py) and stops
them when it ends. The spec's MLX throughput table (superfluid on MLX against mlx_lm.server at 1,
2, 4 and 8 concurrent requests, same model, greedy, 256-token replies, median of 3 rounds):

    python -m tools.bench --target superfluid-mlx=superfluid-mlx:$M --target mlx_lm.server=mlx-lm:$M \\
        --concurrency 1,2,4,8 --rounds 3 --max-tokens 256 --json bench-mlx.json

(add ``--sampled`` for the sampled table). The chat streams of the same run give first-token
time and smoothness.

Modules: prompts (the workload text), method (pure arithmetic and round order),
smoothness (inter-delta gaps and their percentiles), client (HTTP requests), runner (rounds
against targets), launch (servers the bench starts), report (tables, JSON), cli (arguments).
"""
