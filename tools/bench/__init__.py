"""Throughput / TTFT benchmark following the method of spec/benchmarks.md.

Runs against any OpenAI-compatible server by URL, so superfluid and a runtime's own
server (llama-server, mlx_lm.server) are measured by the same client code.

    python -m tools.bench --target superfluid=http://127.0.0.1:8080 \\
                          --target llama-server=http://127.0.0.1:8081

Modules: prompts (the workload text), method (pure arithmetic and round order),
client (HTTP requests), runner (rounds against targets), report (tables, JSON),
cli (arguments).
"""
