"""Reading the operating system's memory pressure."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import psutil

OK, WARNING, CRITICAL = "ok", "warning", "critical"
LEVELS = (OK, WARNING, CRITICAL)

# PSI: share of the last 10 s in which some (or all) tasks stalled on memory.
PSI_SOME_WARNING = 10.0
PSI_FULL_CRITICAL = 10.0
# Available memory as a share of the total.
AVAILABLE_WARNING = 0.10
AVAILABLE_CRITICAL = 0.05


def parse_psi(text: str) -> dict[str, dict[str, float]]:
    """``/proc/pressure/memory`` → {"some": {"avg10": …, …}, "full": {…}}."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        kind, _, rest = line.strip().partition(" ")
        if kind not in ("some", "full"):
            continue
        fields = {}
        for part in rest.split():
            key, _, value = part.partition("=")
            try:
                fields[key] = float(value)
            except ValueError:
                continue
        out[kind] = fields
    return out


def level_from(psi: dict | None, available_fraction: float | None) -> str:
    level = OK
    if psi:
        if psi.get("full", {}).get("avg10", 0.0) >= PSI_FULL_CRITICAL:
            return CRITICAL
        if psi.get("some", {}).get("avg10", 0.0) >= PSI_SOME_WARNING:
            level = WARNING
    if available_fraction is not None:
        if available_fraction < AVAILABLE_CRITICAL:
            return CRITICAL
        if available_fraction < AVAILABLE_WARNING:
            level = WARNING
    return level


def macos_level(value: int) -> str:
    """kern.memorystatus_vm_pressure_level: 1 normal, 2 warning, 4 critical."""
    return {2: WARNING, 4: CRITICAL}.get(value, OK)


class OsPressure:
    """The host's memory pressure: PSI and available memory on Linux, the kernel's level on macOS."""

    name = "os"

    def __init__(self, psi_path: str = "/proc/pressure/memory"):
        self.psi_path = psi_path
        self._libc = None
        if sys.platform == "darwin":
            self._libc = ctypes.CDLL(ctypes.util.find_library("c"))

    def level(self) -> str:
        if self._libc is not None:
            value = ctypes.c_int(0)
            size = ctypes.c_size_t(ctypes.sizeof(value))
            if self._libc.sysctlbyname(b"kern.memorystatus_vm_pressure_level", ctypes.byref(value),
                                       ctypes.byref(size), None, 0) == 0:
                return macos_level(value.value)
            return OK
        psi = None
        try:
            with open(self.psi_path) as fh:
                psi = parse_psi(fh.read())
        except OSError:
            pass
        vm = psutil.virtual_memory()
        return level_from(psi, vm.available / vm.total if vm.total else None)
