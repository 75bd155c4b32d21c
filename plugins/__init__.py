"""Superfluid's built-in plugins. Each is an ordinary plugin, registered through the
``superfluid`` entry-point group exactly as a third party's would be."""
