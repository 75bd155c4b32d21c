"""The chaos scenarios, in the order they run (fleet_partition, slow_readers and
reloads_under_load are not written yet: issue 33)."""

from . import disk_full, kill_mid_write, memory_pressure, soak

ALL = [disk_full, kill_mid_write, memory_pressure, soak]
BY_KEY = {m.KEY: m for m in ALL}
