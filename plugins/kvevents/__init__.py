"""KV events (``--kv-events tcp://…``, off by default): the prefix cache's blocks published in
vLLM's KV-event format over ZMQ, so that llm-d's precise prefix-cache scorer can score this node
like a vLLM pod.

How the block hashes relate to the scorer. llm-d-kv-cache (``pkg/kvevents/pool.go``, checked at
its June 2026 tree) does not use an engine's block hashes as its index keys: for each
``BlockStored`` it recomputes its own keys from the event's ``token_ids`` (``pkg/kvcache/kvblock/
token_processor.go``: chunks of ``blockSizeTokens`` tokens, default 16, each key FNV-64a over the
canonical CBOR of [parent key, chunk, extra], chained from a seed of ``hashSeed`` and the model
name), chaining on the key it recorded for the event's ``parent_block_hash``. The engine's hashes
are only names it maps to those keys, to resolve later parents and ``BlockRemoved``. So ours must
be stable, 64-bit, never 0, chained (a block's name depends on every token before it) and
published before a block names them as parent; the ``token_ids`` must be exactly the cached
tokens of each full block; and ``--kv-events-block-size`` must equal the scorer's
``blockSizeTokens``. ``superfluid.core.block_hash`` says how they are computed; ``blocks.py``
which blocks are published and when; ``wire.py`` the message layout; ``publisher.py`` the socket
and the topic."""

from __future__ import annotations

from superfluid.core.hookspecs import hookimpl

from .options import OPTIONS


@hookimpl
def superfluid_add_config(schema):
    OPTIONS.declare(schema)


@hookimpl
def superfluid_add_frontends(register, config, daemon):
    if OPTIONS.of(config).kv_events:
        from .publisher import KVEventsFrontend
        register(KVEventsFrontend(daemon, config))
