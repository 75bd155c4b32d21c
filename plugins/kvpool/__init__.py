"""KV pool sizing shared by the engine adapters (llama.cpp, MLX): what one KV cell of a model
really costs (``shape``), how many cells and sequences a context gets and which limit decided it
(``layout``), and how much memory the weights leave free on the host (``host_memory``). Nothing
here imports an engine, so both adapters (and their tests) can use it."""
