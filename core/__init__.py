"""Superfluid's small core: requests, lanes, ticks, the scheduler loop, hook specs and config.

The core knows no engine, no HTTP front end and no policy: it reaches them through the
pluggy hooks in :mod:`superfluid.core.hookspecs`.
"""

__version__ = "0.1.0"
