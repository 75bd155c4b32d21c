"""deploy/: every manifest parses and is what it claims; probes ask /health; the pieces name each
other consistently (pool selector ↔ node labels, picker Service and port, route ↔ pool, the
discovery files ↔ the nodes); the serve and fleet command lines parse with the real parsers; and
every metric the endpoint picker's engineConfigs entry names is one a node's /metrics exports."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from superfluid.core.cli import load, main
from superfluid.core.stats import TickStats
from superfluid.plugins.fleet.config import add_arguments as fleet_arguments
from superfluid.plugins.fleet.config import from_args as fleet_config
from superfluid.plugins.fleet.nodes import read_discovery
from superfluid.plugins.http.info.metrics import Metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBE = DEPLOY / "kubernetes"

# (apiVersion, kind) each manifest may use: the versions current for each API in December 2026
KNOWN = {("apps/v1", "Deployment"), ("apps/v1", "StatefulSet"), ("v1", "Service"), ("v1", "ConfigMap"),
         ("v1", "ServiceAccount"), ("rbac.authorization.k8s.io/v1", "Role"),
         ("rbac.authorization.k8s.io/v1", "RoleBinding"), ("networking.k8s.io/v1", "NetworkPolicy"),
         ("inference.networking.k8s.io/v1", "InferencePool"), ("gateway.networking.k8s.io/v1", "Gateway"),
         ("gateway.networking.k8s.io/v1", "HTTPRoute")}
# llm-d-router's core-metrics-extractor engineConfigs fields (extractor/metrics/factories.go, v0.10.0)
ENGINE_FIELDS = {"name", "queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec", "cacheInfoSpec",
                 "cacheBlockSizeLabelName", "cacheNumBlocksLabelName", "cacheBlockSizeSpec",
                 "cacheNumBlocksSpec", "customMetrics"}
SPEC = re.compile(r"^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{([^}]*)\})?\s*$")  # name{label=value,...}


def manifests() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def kube_docs() -> list[dict]:
    docs = []
    for path in sorted(KUBE.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append({**doc, "_file": path.relative_to(DEPLOY).as_posix()})
    return docs


def find(kind: str, name: str | None = None, folder: str | None = None) -> list[dict]:
    return [d for d in kube_docs() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
            and (folder is None or d["_file"].startswith(folder))]


def one(kind: str, name: str | None = None, folder: str | None = None) -> dict:
    found = find(kind, name, folder)
    assert len(found) == 1, f"{kind} {name or ''} in {folder or 'deploy/'}: {len(found)} found"
    return found[0]


def containers(workload: dict) -> list[dict]:
    pod = workload["spec"]["template"]["spec"]
    return pod.get("initContainers", []) + pod["containers"]


def node_workloads() -> list[dict]:
    """The Deployments/StatefulSets whose container runs `superfluid serve`."""
    return [w for w in find("Deployment") + find("StatefulSet")
            if any(c.get("args", [None])[0] == "serve" for c in w["spec"]["template"]["spec"]["containers"])]


def epp_config() -> dict:
    config_map = one("ConfigMap", "superfluid-epp")
    (text,) = config_map["data"].values()
    return yaml.safe_load(text)


def engine_config() -> dict:
    (extractor,) = [p for p in epp_config()["plugins"] if p["type"] == "core-metrics-extractor"]
    (entry,) = [e for e in extractor["parameters"]["engineConfigs"] if e["name"] == "superfluid"]
    return entry


def test_every_manifest_parses_and_each_kind_is_known():
    paths = manifests()
    assert {p.relative_to(DEPLOY).as_posix() for p in paths} >= {
        "kubernetes/gateway/nodes.yaml", "kubernetes/gateway/inferencepool.yaml", "kubernetes/gateway/epp.yaml",
        "kubernetes/gateway/httproute.yaml", "kubernetes/fleet/nodes.yaml", "kubernetes/fleet/head.yaml",
        "compose/docker-compose.yaml"}
    for path in paths:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, path
        if path.parent.name == "compose":
            continue
        for doc in docs:
            assert (doc.get("apiVersion"), doc.get("kind")) in KNOWN, f"{path}: {doc.get('apiVersion')} {doc.get('kind')}"
            assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"]), path


def test_workloads_select_their_own_pods_and_services_their_ports():
    for workload in find("Deployment") + find("StatefulSet"):
        spec = workload["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items(), workload["metadata"]["name"]
    for service in find("Service"):
        pods = [w for w in find("Deployment") + find("StatefulSet")
                if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert pods, f"Service {service['metadata']['name']} selects no workload"
        ports = {p.get("name") for c in containers(pods[0]) for p in c.get("ports", [])} | {
            p["containerPort"] for c in containers(pods[0]) for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port.get("targetPort", port["port"]) in ports, (service["metadata"]["name"], port)


def test_nodes_probe_health_and_carry_the_engine_label():
    nodes = node_workloads()
    assert {w["kind"] for w in nodes} == {"Deployment", "StatefulSet"}  # the gateway's and the head's
    for workload in nodes:
        assert workload["spec"]["template"]["metadata"]["labels"]["llm-d.ai/engine-type"] == "superfluid"
        (serve,) = workload["spec"]["template"]["spec"]["containers"]
        port_names = {p["name"]: p["containerPort"] for p in serve["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = serve[probe]["httpGet"]
            assert get["path"] == "/health", (workload["metadata"]["name"], probe)
            assert port_names.get(get["port"], get["port"]) == 8000
        assert "--port=8000" in serve["args"] and "--host=0.0.0.0" in serve["args"]


def test_the_fleet_head_probes_health():
    head = one("Deployment", "superfluid-fleet")
    (fleet,) = head["spec"]["template"]["spec"]["containers"]
    assert fleet["args"][0] == "fleet"
    assert fleet["readinessProbe"]["httpGet"]["path"] == "/health"


def test_the_pool_selects_the_nodes_and_names_the_picker():
    pool = one("InferencePool", "superfluid")
    node = one("Deployment", "superfluid-node", "kubernetes/gateway")
    pod_labels = node["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (serve,) = node["spec"]["template"]["spec"]["containers"]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [serve["ports"][0]["containerPort"]]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref["failureMode"] in ("FailOpen", "FailClose")
    epp_service = one("Service", ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in epp_service["spec"]["ports"]]
    route = one("HTTPRoute")
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "superfluid"}]
    assert route["spec"]["parentRefs"][0]["name"] == one("Gateway")["metadata"]["name"]


def test_the_picker_runs_its_config_for_this_pool():
    epp = one("Deployment", "superfluid-epp")
    (container,) = epp["spec"]["template"]["spec"]["containers"]
    flags = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    assert flags["pool-name"] == one("InferencePool")["metadata"]["name"]
    assert flags["pool-group"] == "inference.networking.k8s.io"
    mount = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in epp["spec"]["template"]["spec"]["volumes"]}
    directory, filename = flags["config-file"].rsplit("/", 1)
    (volume,) = [name for name, path in mount.items() if path == directory]
    assert volumes[volume]["configMap"]["name"] == "superfluid-epp"
    assert filename in one("ConfigMap", "superfluid-epp")["data"]
    assert epp["spec"]["template"]["spec"]["serviceAccountName"] == one("ServiceAccount")["metadata"]["name"]


def test_the_picker_config_is_well_formed():
    config = epp_config()
    assert (config["apiVersion"], config["kind"]) == ("llm-d.ai/v1alpha1", "EndpointPickerConfig")
    names = {p.get("name") or p["type"] for p in config["plugins"]}
    for profile in config["schedulingProfiles"]:
        assert {p["pluginRef"] for p in profile["plugins"]} <= names
    for source in config.get("dataLayer", {}).get("sources", []):
        assert {source["pluginRef"], *(e["pluginRef"] for e in source["extractors"])} <= names
    (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    params = extractor["parameters"]
    assert params["engineLabelKey"] == "llm-d.ai/engine-type"
    assert params["defaultEngine"] in {e["name"] for e in params["engineConfigs"]}
    entry = engine_config()
    assert set(entry) <= ENGINE_FIELDS, set(entry) - ENGINE_FIELDS
    assert {"queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"} <= set(entry)


def node_exposition() -> dict[str, list]:
    """What a node's /metrics holds: the real Metrics with one model that has ticked, as a daemon
    with a fake runtime (what the collector reads of it) would have it."""
    metrics = Metrics()
    loop = SimpleNamespace(queue=[object()], lanes=[object()])
    metrics.serve_models(lambda: {"smollm2": SimpleNamespace(loop=loop, engine=SimpleNamespace(describe=dict))})
    metrics.tick_done("smollm2", TickStats(
        model="smollm2", seconds=0.01, prefill_tokens=5, decode_tokens=1, prefill_budget=64, decode_grant=1,
        lanes_busy=1, max_lanes=8, queue_depth=1, stopped_early=False, kv_used=300, kv_capacity=2048,
        first_tokens=[], finished=[], queue_by_class={}, lanes_by_class={}))
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


@pytest.mark.parametrize("field", ["queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"])
def test_every_metric_the_engine_config_names_is_exported(field):
    exported = node_exposition()
    spec = engine_config()[field]
    match = SPEC.match(spec)
    assert match, spec
    name, selector = match.group(1), match.group(2) or ""
    wanted = dict(pair.split("=", 1) for pair in filter(None, (p.strip() for p in selector.split(","))))
    wanted = {k.strip(): v.strip().strip('"') for k, v in wanted.items()}
    assert name in exported, f"{field}: {name} is not in a node's /metrics"
    matching = [s for s in exported[name] if wanted.items() <= s.labels.items()]
    assert matching, f"{field}: no {name} series has {wanted}"
    if field == "kvUsageSpec":
        assert 0 <= matching[0].value <= 1
    if field == "cacheInfoSpec":  # the picker reads the layout from two labels
        labels = matching[0].labels
        size = labels[engine_config().get("cacheBlockSizeLabelName") or "block_size"]
        count = labels[engine_config().get("cacheNumBlocksLabelName") or "num_gpu_blocks"]
        assert int(size) > 0 and int(size) * int(count) == 2048


def serve_args(args: list[str], keys: Path) -> list[str]:
    return [a.replace("/etc/superfluid/keys.toml", str(keys)) for a in args]


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    assert main(["keys", "new", "ci", "--file", str(path)]) in (0, None)
    return path


def test_serve_command_lines_parse(keys_file):
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yaml").read_text())
    lines = [c["args"] for w in node_workloads() for c in w["spec"]["template"]["spec"]["containers"]]
    lines.append(compose["services"]["node"]["command"])
    for args in lines:
        config, _pm = load(serve_args(args, keys_file))
        assert config["host"] == "0.0.0.0" and config["port"] == 8000
        # a non-loopback node checks keys, or says it does not on purpose (the gateway's nodes)
        assert config.get("key-policy") or config.get("insecure"), args


def fleet_line(args: list[str]):
    parser = argparse.ArgumentParser()
    fleet_arguments(parser)
    return fleet_config(parser.parse_args(args))


def test_the_k8s_head_finds_every_node_of_the_statefulset(tmp_path):
    head = one("Deployment", "superfluid-fleet")
    (container,) = head["spec"]["template"]["spec"]["containers"]
    config = fleet_line(container["args"][1:])
    directory, filename = config.discovery_file.rsplit("/", 1)
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
    (volume,) = [v for v in head["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    nodes_json = one("ConfigMap", volume["configMap"]["name"])["data"][filename]
    path = tmp_path / filename
    path.write_text(nodes_json)
    sts = one("StatefulSet", "superfluid-fleet-node")
    want = [f"http://{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}:8000"
            for i in range(sts["spec"]["replicas"])]
    assert read_discovery(str(path)) == want
    assert one("Service", sts["spec"]["serviceName"])["spec"]["clusterIP"] == "None"


def test_compose_head_and_nodes():
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yaml").read_text())
    node, fleet = compose["services"]["node"], compose["services"]["fleet"]
    assert "/health" in " ".join(node["healthcheck"]["test"]) and "/health" in " ".join(fleet["healthcheck"]["test"])
    assert fleet["profiles"] == ["head"] and fleet["command"][0] == "fleet"
    config = fleet_line(fleet["command"][1:])
    mounts = dict(v.split(":")[1::-1] for v in fleet["volumes"])  # container path -> host path
    host_dir = mounts[config.discovery_file.rsplit("/", 1)[0]]
    urls = read_discovery(str(DEPLOY / "compose" / host_dir / config.discovery_file.rsplit("/", 1)[1]))
    assert urls and all(u.startswith("http://") and u.endswith(":8000") for u in urls)
    assert json.loads((DEPLOY / "compose" / "head" / "nodes.json").read_text())["version"] == 1
