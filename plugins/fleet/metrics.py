"""One Prometheus page for the fleet: every node's metrics with a ``node="URL"`` label, the
head's own counters, and SMG's metrics (routing, retries, circuit breakers, its view of each
worker's health), so one scrape of the head shows the whole fleet.

Node pages are parsed and re-rendered with prometheus_client rather than edited as text: the
same metric family comes from every node, and the exposition format allows its ``# TYPE`` line
once per page."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class HeadMetrics:
    """The head's own counters and gauges, in a registry of their own."""

    def __init__(self):
        disable_created_metrics()  # the head's own process: *_created series are noise here
        self.registry = CollectorRegistry()
        self.requests = Counter("superfluid_fleet_requests", "Requests the fleet head answered, by route and status",
                                ["route", "status"], registry=self.registry)
        self.errors = Counter("superfluid_fleet_errors", "Failures at the head, by kind (smg_unreachable, node_lost, "
                              "node_unavailable, stream_cut, retried)", ["kind"], registry=self.registry)
        self.node_healthy = Gauge("superfluid_fleet_node_healthy", "1 if the node's /health answered at the "
                                  "head's last poll", ["node"], registry=self.registry)
        self.smg_up = Gauge("superfluid_fleet_smg_up", "1 while SMG answers its /health", registry=self.registry)
        self.smg_restarts = Counter("superfluid_fleet_smg_restarts", "Times the head restarted SMG after it exited",
                                    registry=self.registry)
        self.sessions = Gauge("superfluid_fleet_sessions", "Sessions the head knows, by the node that holds them", ["node"],
                              registry=self.registry)


def relabel(texts: dict[str, str]) -> list[Metric]:
    """Families from each node's page (node URL -> text), each sample labelled with its node.
    A page that does not parse is left out (the node's health gauge says it is down)."""
    families: dict[str, Metric] = {}
    for node, text in texts.items():
        try:
            parsed = list(text_string_to_metric_families(text))
        except (ValueError, TypeError, IndexError):
            continue
        for fam in parsed:
            out = families.get(fam.name)
            if out is None:
                out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                out.add_sample(s.name, {**s.labels, "node": node}, s.value, s.timestamp, s.exemplar)
    return list(families.values())


def plain(text: str | None) -> list[Metric]:
    """Families of one page as they are (SMG's)."""
    if not text:
        return []
    try:
        return list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError):
        return []


class _Static:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families


def render(head: HeadMetrics, node_texts: dict[str, str], smg_text: str | None) -> bytes:
    """The whole page: the head's registry, then the nodes', then SMG's."""
    page = CollectorRegistry(auto_describe=False)
    page.register(_Static(relabel(node_texts) + plain(smg_text)))
    return generate_latest(head.registry) + generate_latest(page)
