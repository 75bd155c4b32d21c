"""The lane-ownership guard: a check, off by default, that every write to a lane's fields comes
from the lane's own methods.

``core/lane.py`` owns a lane's state: the scheduler, the KV manager and every plugin change a lane
only through its methods (the prompt work's own fields are ``core/prompt_work.py``'s). A stray
write elsewhere works until two writers disagree, so it is checked rather than trusted. The
guard replaces ``Lane.__setattr__`` with one that looks at the writing frame's file: a write from a
file of the daemon (``core/`` or ``plugins/``) other than the owners is a *stray*. Writes from
anywhere else (tests setting lanes up, a third-party plugin's own checks) pass.

Two users, one rule:

- the unit tests' autouse fixture (``tests/unit/conftest.py``) installs it around every test and
  fails the test on a stray;
- the daemon installs it at start when ``SUPERFLUID_LANE_GUARD`` is set (the server tests set
  it): each stray is logged as an error and, when the variable names a file, appended to it, so
  the server tests' fixture (``tests/server/conftest.py``) fails the test that caused it. A
  plugin author can run their plugin under the same switch.

The frame lookup costs a little on every lane write, which is why it is never on in production."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Callable

from .lane import Lane

log = logging.getLogger("superfluid.lane_guard")

ENV = "SUPERFLUID_LANE_GUARD"  # set (to a file for the strays, or to 1): the daemon installs the guard
PROMPT_WORK_FIELDS = frozenset({"prompt_logprobs", "scores_sent", "embedding_sum", "pooled"})

CORE = Path(__file__).parent  # as the import system spells it, like the frames' file names
DAEMON = (CORE, CORE.parent / "plugins")  # superfluid.plugins sits beside core, in a checkout or installed


def is_stray(path: Path, name: str) -> bool:
    """Whether a write of field ``name`` from file ``path`` breaks the ownership rule."""
    if path == CORE / "lane.py" or (path == CORE / "prompt_work.py" and name in PROMPT_WORK_FIELDS):
        return False
    return any(d in path.parents for d in DAEMON)


def install(on_stray: Callable[[str, str], None]) -> Callable[[], None]:
    """Guard ``Lane``'s field writes; ``on_stray(file, field)`` is called for each stray one (the
    write still happens). Returns the function that takes the guard off again."""
    previous = Lane.__dict__.get("__setattr__")

    def owned_setattr(lane, name, value):
        path = Path(sys._getframe(1).f_code.co_filename)
        if is_stray(path, name):
            on_stray(str(path), name)
        object.__setattr__(lane, name, value)

    Lane.__setattr__ = owned_setattr

    def uninstall() -> None:
        if previous is None:
            del Lane.__setattr__
        else:
            Lane.__setattr__ = previous

    return uninstall


def install_from_environment(environ=os.environ) -> Callable[[], None] | None:
    """The daemon's switch: with ``SUPERFLUID_LANE_GUARD`` set, guard lanes (for the process's
    life), logging each stray (file, field) once as an error and appending it to the file the
    variable names (unless it is ``1``). Returns the guard's uninstall, or None when it is off."""
    target = environ.get(ENV, "")
    if not target:
        return None
    seen: set[tuple[str, str]] = set()

    def report(path: str, name: str) -> None:
        if (path, name) in seen:
            return
        seen.add((path, name))
        log.error("lane guard: Lane.%s written by %s, not by the lane's own methods (core/lane.py)",
                  name, path)
        if target != "1":
            with open(target, "a") as out:
                out.write(f"{os.getpid()} {path} Lane.{name}\n")

    uninstall = install(report)
    log.info("lane guard on: stray lane writes are logged%s", "" if target == "1" else f" to {target}")
    return uninstall
