"""The MLX engine adapter (mlx-lm). Not built yet: it is not registered as an engine, so
``--engine mlx`` fails at startup with the list of installed engines."""
