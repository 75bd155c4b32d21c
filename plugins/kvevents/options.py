"""The KV events options, read back typed: ``OPTIONS.of(config).kv_events_topic``.
(``--kv-events-block-size`` is the core's: /metrics counts KV in the same blocks; the topic's
``{host}`` and ``{port}`` are the core's ``--host`` and ``--port``.)"""

from superfluid.core.options import Option, PluginOptions

from .endpoint import DEFAULT_TOPIC, check_endpoint, check_topic
from .wire import ENCODINGS

OPTIONS = PluginOptions("kvevents", [
    Option("kv-events", str, "", "publish the prefix cache's blocks as vLLM KV events on a ZMQ "
           "PUB socket for llm-d's precise prefix scorer: tcp://*:5557 binds (the indexer "
           "connects), tcp://HOST:PORT connects to an indexer that binds (default: off)",
           check_endpoint, metavar="ENDPOINT"),
    Option("kv-events-topic", str, DEFAULT_TOPIC, "the ZMQ topic of each model's events; "
           "{host} and {port} are --host (a wildcard: this machine's address) and --port, "
           "{model} the model's name (llm-d expects kv@POD-IP:PORT@MODEL)", check_topic,
           metavar="TOPIC"),
    Option("kv-events-encoding", str, "array", "how each event is encoded: array (positional, "
           "as vLLM before June 2026; every llm-d-kv-cache release reads it) or map (named "
           "fields, as vLLM since)",
           lambda v: None if v in ENCODINGS else "must be array or map", metavar="ENCODING"),
])
