"""The fleet head's small parts, without processes: the QoS class moved from the header into the
body, the discovery file, session placement, and the fleet's Prometheus page."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from superfluid.plugins.fleet.metrics import HeadMetrics, render
from superfluid.plugins.fleet.nodes import Node, NodeMonitor, read_discovery
from superfluid.plugins.fleet.body import carry_class
from superfluid.plugins.fleet.sessions import SessionMap


def test_header_class_moves_into_the_body():
    raw = json.dumps({"model": "m", "messages": []}).encode()
    assert json.loads(carry_class(raw, "background"))["superfluid"] == {"qos": "background"}
    assert carry_class(raw, None) == raw  # no header: the body as sent


def test_body_class_wins_and_other_fields_stay():
    raw = json.dumps({"model": "m", "superfluid": {"qos": "interactive"}}).encode()
    assert carry_class(raw, "background") == raw
    raw = json.dumps({"model": "m", "superfluid": {}, "temperature": 0}).encode()
    body = json.loads(carry_class(raw, "agent"))
    assert body == {"model": "m", "superfluid": {"qos": "agent"}, "temperature": 0}


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'{"superfluid": "batch"}', b"\xff\xfe"])
def test_bodies_the_node_must_refuse_pass_unchanged(raw):
    assert carry_class(raw, "background") == raw


def test_discovery_file_formats(tmp_path):
    f = tmp_path / "nodes.json"
    f.write_text(json.dumps({"version": 1, "workers": [{"url": "http://127.0.0.1:9001/"}, {"url": "http://h:2"}]}))
    assert read_discovery(str(f)) == ["http://127.0.0.1:9001", "http://h:2"]
    f.write_text(json.dumps(["http://127.0.0.1:9001"]))
    assert read_discovery(str(f)) == ["http://127.0.0.1:9001"]
    f.write_text(json.dumps({"version": 1, "workers": [{"url": "nope"}]}))
    with pytest.raises(ValueError, match=r"workers\[0\]\.url"):
        read_discovery(str(f))
    f.write_text("{")
    with pytest.raises(ValueError):
        read_discovery(str(f))


def test_sessions_go_to_the_least_busy_healthy_node_serving_the_model():
    monitor = NodeMonitor((), None, on_change=lambda healthy: None)
    monitor.nodes = {
        "http://a": Node("http://a", healthy=True, models=("m",), busy=3),
        "http://b": Node("http://b", healthy=True, models=("m",), busy=1),
        "http://c": Node("http://c", healthy=False, models=("m",), busy=0),
        "http://d": Node("http://d", healthy=True, models=("other",), busy=0),
    }
    sessions = SessionMap(monitor)
    assert sessions.place("m").url == "http://b"
    assert sessions.place("other").url == "http://d"
    assert sessions.place("absent") is None
    monitor.nodes["http://a"].busy = 1  # a tie on load: the node holding fewer sessions
    sessions.remember("s1", "http://b")
    assert sessions.place("m").url == "http://a"
    assert sessions.node_of("s1") == "http://b"
    sessions.forget("s1")
    assert sessions.node_of("s1") is None


NODE_PAGE = """# HELP superfluid_requests_total Requests
# TYPE superfluid_requests_total counter
superfluid_requests_total{model="m",qos="agent"} 3.0
# HELP superfluid_kv_used Occupancy
# TYPE superfluid_kv_used gauge
superfluid_kv_used{model="m"} 0.5
"""


def test_metrics_page_labels_each_node_and_adds_the_heads_own():
    head = HeadMetrics()
    head.node_healthy.labels("http://a").set(1)
    head.node_healthy.labels("http://b").set(0)
    smg = "# HELP smg_worker_health h\n# TYPE smg_worker_health gauge\nsmg_worker_health{worker=\"http://a\"} 1\n"
    page = render(head, {"http://a": NODE_PAGE, "http://b": NODE_PAGE.replace("3.0", "5.0")}, smg).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(page) for s in fam.samples}
    assert samples[("superfluid_requests_total", (("model", "m"), ("node", "http://a"), ("qos", "agent")))] == 3
    assert samples[("superfluid_requests_total", (("model", "m"), ("node", "http://b"), ("qos", "agent")))] == 5
    assert samples[("superfluid_fleet_node_healthy", (("node", "http://b"),))] == 0
    assert samples[("smg_worker_health", (("worker", "http://a"),))] == 1
    assert page.count("# TYPE superfluid_requests_total counter") == 1  # once per page, not per node
    bad = render(head, {"http://a": "garbage{{{ 1"}, None).decode()  # a bad page is left out
    assert "garbage" not in bad and "superfluid_fleet_node_healthy" in bad
