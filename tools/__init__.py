"""Outside clients of superfluid: they speak its HTTP API like any user would."""
