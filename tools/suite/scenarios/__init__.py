"""One module per scenario of spec/benchmarks.md "Serving semantics". Each module has:

* ``KEY``, ``TITLE``;
* ``FULL`` and ``FAST`` parameter dicts (the full run and the test subset);
* ``unsupported(kind) -> str | None``: why a target has no way to run it (verdict n/a);
* ``config(kind, p, state_dir) -> ServeConfig``: how the server is started for it;
* ``async run(ctx) -> Outcome``.
"""

from . import (agents_chat, daemon_restart, disconnect, kv_exhaustion, shared_prefix, tool_session,
               unload, worker_kill)

ALL = [worker_kill, daemon_restart, agents_chat, kv_exhaustion, unload, tool_session, disconnect,
       shared_prefix]
BY_KEY = {m.KEY: m for m in ALL}
