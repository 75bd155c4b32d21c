"""The memory cgroup the daemon runs in, as a pressure source.

In a container (Docker, Kubernetes, systemd's MemoryMax) the kernel OOM-kills at the cgroup's
limit, however much the host has free: the host's PSI and free memory read "ok" until the kill.
So the ladder also reads the cgroup: its working set (usage less inactive file pages, which the
kernel reclaims before it kills; what Kubernetes calls the working set) against its limit, the
same thresholds as the host's available memory, and on cgroup v2 the cgroup's own PSI. The engine
worker inherits the daemon's cgroup, so one reading covers both. Every ancestor with a limit
counts: the tightest decides.

cgroup v1 (``N:memory:/path``) and v2 (``0::/path``) are both read; a missing or unreadable file
means "no limit known", never an error."""

from __future__ import annotations

from pathlib import Path

from .sources import LEVELS, OK, level_from, parse_psi

V1_UNLIMITED = 0x7FFFFFFFFFFFF000  # what v1 reports for "no limit" on 64-bit kernels (page-rounded)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _int(path: Path) -> int | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:  # v2's "max"
        return None


def _stat(path: Path, key: str) -> int:
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def memory_cgroup_dirs(proc_cgroup: str, root: Path) -> list[Path]:
    """The memory cgroup's folder and its ancestors' up to the mount, innermost first. A path
    that does not exist under the mount (a container sees the host's path) falls back to the
    mount itself, which is then the container's own cgroup."""
    v1 = v2 = None
    for line in proc_cgroup.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if "memory" in controllers.split(","):
            v1 = path
        elif parts[0] == "0" and controllers == "":
            v2 = path
    if v1 is not None:
        mount = root / "memory"
        path = v1
    elif v2 is not None and "memory" in (_read(root / "cgroup.controllers") or "").split():
        mount = root
        path = v2
    else:
        return []
    here = mount / path.lstrip("/")
    if not here.is_dir():
        here = mount
    if not here.is_dir():
        return []
    dirs = [here]
    while dirs[-1] != mount and mount in dirs[-1].parents:
        dirs.append(dirs[-1].parent)
    return dirs


class CgroupMemory:
    """The tightest memory limit among the process's cgroup and its ancestors, read at every
    ``level()`` call (cheap: a few small files)."""

    name = "cgroup"

    def __init__(self, proc_cgroup: str | None = None, root: Path | str = "/sys/fs/cgroup"):
        if proc_cgroup is None:
            proc_cgroup = _read(Path("/proc/self/cgroup")) or ""
        self.dirs = memory_cgroup_dirs(proc_cgroup, Path(root))

    def level(self) -> str:
        worst = 0
        for d in self.dirs:
            worst = max(worst, LEVELS.index(self._level_of(d)))
        return LEVELS[worst]

    @staticmethod
    def _level_of(d: Path) -> str:
        if (d / "memory.max").exists() or (d / "memory.current").exists():  # v2
            limit, usage = _int(d / "memory.max"), _int(d / "memory.current")
            inactive = _stat(d / "memory.stat", "inactive_file")
            psi_text = _read(d / "memory.pressure")
            psi = parse_psi(psi_text) if psi_text else None
        else:  # v1
            limit, usage = _int(d / "memory.limit_in_bytes"), _int(d / "memory.usage_in_bytes")
            if limit is not None and limit >= V1_UNLIMITED:
                limit = None
            inactive = _stat(d / "memory.stat", "total_inactive_file")
            psi = None
        available = None
        if limit and usage is not None:
            available = max(limit - max(usage - inactive, 0), 0) / limit
        if available is None and psi is None:
            return OK
        return level_from(psi, available)
