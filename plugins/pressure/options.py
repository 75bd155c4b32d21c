"""The OS pressure source's option, read back typed: ``OPTIONS.of(config).os_pressure``."""

from superfluid.core.options import Option, PluginOptions

OPTIONS = PluginOptions("pressure", [
    Option("os-pressure", bool, True, "evict cached prefixes (and, when critical, preempt "
           "decoding background lanes) under OS memory pressure"),
])
