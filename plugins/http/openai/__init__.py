"""The OpenAI API: chat and text completions (with llama.cpp server's /infill beside them),
embeddings and llama-server's /tokenize and /detokenize; each route validates through the
shared preparation path (:mod:`..prepare`) and shapes OpenAI's replies here."""
