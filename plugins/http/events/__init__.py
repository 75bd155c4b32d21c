"""GET /events and the dashboard: the hub that turns ticks into snapshots for any number of
watchers, its readers, per-key counts, and the routes (``superfluid top`` is a client of
the same stream, in :mod:`..cli`)."""
