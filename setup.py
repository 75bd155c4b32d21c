"""The one compiled part: the llama.cpp worker's decode loop (plugins/llamacpp/_rounds.c).

Everything else is in pyproject.toml. The extension is optional: where it cannot be built the
worker runs the same loop in Python."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("superfluid.plugins.llamacpp._rounds", ["plugins/llamacpp/_rounds.c"],
                             extra_compile_args=["-O3"], optional=True)])
