"""The serving-semantics suite of spec/benchmarks.md: eight scenarios, each with a pass condition
checked by code, run against superfluid and its peers. See README.md.

    python -m tools.suite --targets superfluid,llama-server,llama-cpp-python --out docs/suite
"""
