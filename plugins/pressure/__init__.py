"""OS memory pressure as a pressure source (``--os-pressure``, on by default).

Linux reads PSI (``/proc/pressure/memory``) and available memory (psutil); macOS reads
``kern.memorystatus_vm_pressure_level``. Another plugin can add sources of its own through
``superfluid_add_pressure_sources``; ``--no-os-pressure`` turns this one off.

Beside the host's, the memory cgroup the daemon runs in (:mod:`.cgroup`): in a container the
kernel kills at the cgroup's limit while the host still has memory to spare."""

from __future__ import annotations

from superfluid.core.hookspecs import hookimpl

from .options import OPTIONS
from .cgroup import CgroupMemory
from .sources import OsPressure


@hookimpl
def superfluid_add_config(schema):
    OPTIONS.declare(schema)


@hookimpl
def superfluid_add_pressure_sources(register, config):
    if OPTIONS.of(config).os_pressure:
        register(OsPressure())
        register(CgroupMemory())
