"""The chaos scenarios, in the order they run (fleet_partition and slow_readers are not written
yet: issue 33)."""

from . import disk_full, kill_mid_write, memory_pressure, reloads_under_load, soak

ALL = [disk_full, kill_mid_write, memory_pressure, reloads_under_load, soak]
BY_KEY = {m.KEY: m for m in ALL}
