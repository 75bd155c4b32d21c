"""Whether llama.cpp may keep a model's weights in its extra CPU buffer types.

When llama.cpp loads a model it can move weights into "extra" buffer types of its CPU backend:
``CPU_REPACK`` interleaves Q4_0, Q4_K, Q8_0 and similar blocks so that batched matrix products
(prefill) run faster, and a build compiled on an Intel CPU with AMX puts an ``AMX`` type ahead of
it. That AMX path faults on any decode batch of more than one token with Q4_1 or Q8_0 weights
(llama.cpp issue #20824), and computes Q4_0 and Q4_1 wrongly where it does not fault (PR #16315).

llama.cpp has one switch for all of them, ``llama_model_params.use_extra_bufts`` (llama-server's
``--no-repack``). AMX cannot be dropped alone at load time: a tensor override to the plain CPU
type re-selects from the same list, AMX first, and an override to ``CPU_REPACK`` is taken without
checking that the repack type can hold the tensor (docs/configuration.md says more). So ``auto``
turns every extra type off where llama.cpp's own CPU report names AMX, and keeps them elsewhere.

The report is ``llama_print_system_info()``. Tests feed another one in through the environment
variable ``SUPERFLUID_TEST_CPU_REPORT``, so that the AMX branch runs on any machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import sys
from typing import Iterator

import attrs

MODES = ("auto", "on", "off")
REPORT_ENV = "SUPERFLUID_TEST_CPU_REPORT"
FLAG = "--llama-extra-buffers"
AMX_FEATURES = ("AMX_INT8",)


def one_of_modes(value) -> str | None:
    """The option's validator: None when ``value`` is a mode, else what is wrong."""
    return None if value in MODES else f"must be one of {', '.join(MODES)}"


def parse_report(report: str) -> dict[str, dict[str, str]]:
    """``"CPU : SSE3 = 1 | AVX2 = 1 | REPACK = 1 | "`` as ``{"CPU": {"SSE3": "1", ...}}``.

    llama.cpp writes each backend's name, `` : ``, then ``NAME = VALUE | `` per feature, and runs
    the next backend's name straight after the last ``|``."""
    backends: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for piece in report.split("|"):
        piece = piece.strip()
        if not piece:
            continue
        if " : " in piece:
            backend, _, piece = piece.partition(" : ")
            current = backends.setdefault(backend.strip(), {})
        name, _, value = piece.partition("=")
        if current is None:
            current = backends.setdefault("CPU", {})
        current[name.strip()] = value.strip()
    return backends


def names_amx(features: dict[str, dict[str, str]]) -> bool:
    """Whether any backend reports an AMX feature as present."""
    return any(values.get(name, "0") not in ("", "0") for values in features.values()
               for name in AMX_FEATURES)


@attrs.frozen
class ExtraBuffers:
    """The decision for one model: the mode asked for, the choice and why, and the report."""

    mode: str
    use: bool
    reason: str
    report: str
    report_source: str = "llama_print_system_info"

    @property
    def features(self) -> dict[str, dict[str, str]]:
        return parse_report(self.report)

    def turned_off(self, why: str) -> "ExtraBuffers":
        """The same decision with the extra types off, because of ``why``."""
        return attrs.evolve(self, use=False, reason=why)

    def describe(self) -> dict:
        """What /health shows."""
        return {"mode": self.mode, "used": self.use, "reason": self.reason,
                "report_source": self.report_source}


def cpu_report() -> tuple[str, str]:
    """(llama.cpp's CPU report, where it came from): the environment's test report if set."""
    fed = os.environ.get(REPORT_ENV)
    if fed is not None:
        return fed, REPORT_ENV
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode(errors="replace"), "llama_print_system_info"


def choose(mode: str = "auto", report: str | None = None) -> ExtraBuffers:
    """Decide for ``mode``: ``on`` and ``off`` are taken as asked; ``auto`` is off where the
    report names AMX and on elsewhere."""
    if mode not in MODES:
        raise ValueError(f"{FLAG} must be one of {', '.join(MODES)}, not {mode!r}")
    source = "given"
    if report is None:
        report, source = cpu_report()
    amx = names_amx(parse_report(report))
    if mode == "on":
        use, reason = True, f"{FLAG} on"
    elif mode == "off":
        use, reason = False, f"{FLAG} off"
    elif amx:
        use, reason = False, ("auto: llama.cpp's CPU report names AMX_INT8, whose extra buffer type "
                              "crashes on batched decodes (llama.cpp #20824)")
    else:
        use, reason = True, "auto: no AMX in llama.cpp's CPU report; CPU repacking speeds up prefill"
    return ExtraBuffers(mode=mode, use=use, reason=reason, report=report, report_source=source)


def model_params(use: bool):
    """``llama_model_default_params()`` with the extra buffer types on or off."""
    import llama_cpp

    params = llama_cpp.llama_model_default_params()
    params.use_extra_bufts = bool(use)
    return params


@contextlib.contextmanager
def llama_defaults(use: bool) -> Iterator[None]:
    """Make ``llama_cpp.Llama(...)`` built inside the block load its model with the extra buffer
    types on or off. ``Llama`` takes no argument for it; it builds its parameters from
    ``llama_model_default_params``, which this replaces for the block's duration."""
    from llama_cpp import llama_cpp as low

    original = low.llama_model_default_params

    def defaults():
        params = original()
        params.use_extra_bufts = bool(use)
        return params

    low.llama_model_default_params = defaults
    try:
        yield
    finally:
        low.llama_model_default_params = original


def reference_llama(*args, extra_buffers: str = "auto", **kwargs):
    """A ``llama_cpp.Llama`` loaded under the same decision the worker makes (tests' and benches'
    references must not take the path the server avoids)."""
    import llama_cpp

    with llama_defaults(choose(extra_buffers).use):
        return llama_cpp.Llama(*args, **kwargs)


BUFFER_LINE = re.compile(r"(\S+) model buffer size =\s*([0-9.]+) MiB")
LOG_ERROR = 3  # ggml_log_level GGML_LOG_LEVEL_ERROR


@contextlib.contextmanager
def weight_buffers(into: dict[str, float]) -> Iterator[None]:
    """While loading a model, collect llama.cpp's ``NAME model buffer size = N MiB`` lines into
    ``into`` (buffer type -> MiB): where the weights actually went (``CPU_REPACK``, ``AMX``,
    ``CPU_Mapped``), which no API of llama.cpp's reports. Errors still reach stderr; on leaving,
    llama-cpp-python's own log callback is put back."""
    import llama_cpp
    from llama_cpp import _logger

    @llama_cpp.llama_log_callback
    def collect(level, text, _user):
        line = text.decode(errors="replace")
        found = BUFFER_LINE.search(line)
        if found:
            into[found.group(1)] = round(into.get(found.group(1), 0.0) + float(found.group(2)), 2)
        if level == LOG_ERROR:
            sys.stderr.write(line)

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        yield
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
