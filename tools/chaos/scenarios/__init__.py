"""The chaos scenarios, in the order they run."""

import importlib

ORDER = ["disk_full", "kill_mid_write", "memory_pressure", "fleet_partition", "slow_readers",
         "reloads_under_load", "soak"]


def _load(name):
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:  # TEMPORARY while scenarios are being written
        if e.name == f"{__name__}.{name}":
            return None
        raise


ALL = [m for m in map(_load, ORDER) if m is not None]
BY_KEY = {m.KEY: m for m in ALL}
