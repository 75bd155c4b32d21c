"""The fleet head (``superfluid fleet``): one OpenAI endpoint in front of several
``superfluid serve`` nodes, built on SMG (Shepherd Model Gateway, PyPI ``smg``).

What SMG does (its data plane, started and supervised by the head, :mod:`.smg`): routing by
policy (cache_aware by default) and by model, the union of the nodes' ``/v1/models`` and the 404
for an unknown model, health checks, retries of failed non-streamed requests on another node,
circuit breakers, an SSE error event for a stream cut by a dying node, and its worker API,
through which the head registers the nodes.

What the head adds (only what SMG lacks for superfluid):

- the spec's refusals of the local-scheduler options (:mod:`.config`);
- the QoS class carried to the nodes in the body (SMG drops ``x-superfluid-*`` headers) and
  ``Authorization`` passed through (:mod:`.proxy`);
- session affinity for ``/v1/sessions`` (:mod:`.sessions`);
- the node list SMG routes to: the nodes whose ``/health`` answers, polled every second, each
  registered with its models (a node with a key policy hides its ``/v1/models`` from SMG), so a
  node down at start or back from the dead is routed to within a second or two (:mod:`.nodes`);
- one ``/health`` and ``/metrics`` for the fleet (:mod:`.metrics`), SMG restarted if it dies,
  and an error event for a stream that ends without ``[DONE]`` for any other reason.

Imports only superfluid.core and its own modules."""

from superfluid.core.hookspecs import hookimpl


@hookimpl
def superfluid_add_commands(register):
    from . import command
    register("fleet", command.HELP, command.add_arguments, command.run)
