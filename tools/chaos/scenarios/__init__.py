"""The chaos scenarios, in the order they run (fleet_partition is not written yet: issue 33)."""

from . import disk_full, kill_mid_write, memory_pressure, reloads_under_load, slow_readers, soak

ALL = [disk_full, kill_mid_write, memory_pressure, slow_readers, reloads_under_load, soak]
BY_KEY = {m.KEY: m for m in ALL}
