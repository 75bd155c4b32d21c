"""Reranking and scoring: ``/v1/rerank`` (llama-server's, vLLM's, Jina's and Cohere's shape) and
``/v1/score`` (vLLM's), served by a reranker model through the embedding lanes."""
