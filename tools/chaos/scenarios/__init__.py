"""The chaos scenarios, in the order they run."""

from . import disk_full, fleet_partition, kill_mid_write, memory_pressure, reloads_under_load, slow_readers, soak

ALL = [disk_full, kill_mid_write, memory_pressure, slow_readers, reloads_under_load, fleet_partition, soak]
BY_KEY = {m.KEY: m for m in ALL}
