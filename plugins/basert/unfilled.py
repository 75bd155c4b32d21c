"""Layers whose weights are loaded after they are built (the towers are built on the meta device,
then given the file's tensors), made without their random init.

Most arithmetic on the meta device runs through torch's Python decompositions, and the first call
of one imports ``torch._dynamo``: about a second of every basert start. nn.Embedding's random
init is such arithmetic, for values that are thrown away (so are the RoPE tables, which
``model.Transformer.set_buffers`` therefore computes on the CPU)."""

from __future__ import annotations

import torch
from torch import nn


def embedding(rows: int, width: int) -> nn.Embedding:
    """An nn.Embedding of ``rows`` x ``width`` on the current device, its weight left unfilled."""
    return nn.Embedding.from_pretrained(torch.empty(rows, width), freeze=True)
