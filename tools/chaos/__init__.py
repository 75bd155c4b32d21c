"""Faults on purpose: scenarios that break disks, processes, networks and clients while superfluid
serves, each with a pass condition checked in code (``python -m tools.chaos``)."""
