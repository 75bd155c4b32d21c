"""basert, Superfluid's native in-process engine. Not built yet: it is not registered as an
engine, so ``--engine basert`` fails at startup with the list of installed engines."""
