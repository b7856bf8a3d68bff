"""Dashboards, alerts and deploy files against the real daemon and their own formats.

Every ``kvoffload_*`` name in a Grafana panel or an alert rule must be exported by a running
daemon *with samples* after a demo run (one test case per name, so a missing one names itself),
and every label value a selector pins must occur. The dashboard JSON, the alert rules, the
Kubernetes manifests, the systemd unit and the example config are checked structurally.
"""

from __future__ import annotations

import configparser
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
import zmq
from kvoffload.bench.workload import PRESETS
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.base import make_key
from kvoffload.daemon.config import Config, load_config
from kvoffload.daemon.control import protocol as p
from prometheus_client.parser import text_string_to_metric_families

from tests.daemon_helpers import run_daemon

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = json.loads((ROOT / "dashboards/kvoffload.json").read_text())
ALERTS = yaml.safe_load((ROOT / "dashboards/alerts.yaml").read_text())
K8S = ROOT / "deploy/kubernetes"

# The daemon's names; vllm:kvoffload_* are vLLM engines' (tests/connector/vllm/
# test_session_metrics.py checks those against vLLM's metrics path).
NAME_RE = re.compile(r"(?<!vllm:)kvoffload_[a-z0-9_]+")
SELECTOR_RE = re.compile(r"(?<!vllm:)(kvoffload_[a-z0-9_]+)\{([^}]*)\}")
MATCHER_RE = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
BY_RE = re.compile(r"by\s*\(([^)]*)\)\s*\(\s*(?:\w+\()?\s*(kvoffload_[a-z0-9_]+)")
TARGET_LABELS = {"job", "instance"}  # added by Prometheus at scrape time, not by the daemon
GRAFANA_BUILTINS = {"__rate_interval", "__range", "__interval"}


def _queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target, query variable and alert rule."""
    out = []
    for panel in DASHBOARD["panels"]:
        for t in panel.get("targets", []):
            out.append((f"panel {panel['title']!r}", t["expr"]))
    for var in DASHBOARD["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]
            out.append((f"variable {var['name']}", q["query"] if isinstance(q, dict) else q))
    for group in ALERTS["groups"]:
        for rule in group["rules"]:
            out.append((f"alert {rule['alert']}", rule["expr"]))
    return out


QUERIES = _queries()
NAMES = sorted({n for _, q in QUERIES for n in NAME_RE.findall(q)})
SELECTORS = sorted({(m.group(1), m.group(2)) for _, q in QUERIES
                    for m in SELECTOR_RE.finditer(q)})


# -- a daemon that has seen everything the dashboards show ---------------------------------


def _metrics_text(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return resp.read().decode()


def _provoke_rare_outcomes(control: str) -> None:
    """A protocol error, stores refused for lack of space, and a client that dies mid-store."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(control)
    sock.send(b"\xc1 not msgpack")
    assert sock.poll(10_000), "no reply to a malformed frame"
    reply = p.reply_decoder.decode(sock.recv())
    assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.MALFORMED
    sock.close()
    # Reserve more slots than the pool has and never commit: the first ones evict the demo's
    # blocks, the rest are refused (nothing evictable is left), and when this client's short
    # lease runs out the daemon releases its pending stores.
    geometry = PRESETS["qwen3.6-27b-tp1"].geometry(1 / 1024)  # the demo's: same slot size
    client = DaemonClient(control, timeout_ms=10_000, name="abandons its stores", lease_ms=100)
    client.register(geometry)
    slots = client.stats()["num_slots"]
    end = geometry.groups[0].tokens_per_block
    items = [p.StoreItem(key=make_key(i.to_bytes(32, "big"), 0), end_token=end)
             for i in range(1, slots + 5)]
    outcomes = client.prepare_store(items).outcomes
    assert p.StoreOutcome.GRANTED in outcomes and p.StoreOutcome.NO_SPACE in outcomes
    client._reset_socket()  # vanish without a goodbye: the lease must clean up


def _value(text: str, name: str, **labels: str) -> float:
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Sample name -> (family type, [labels]) from a daemon after a demo and the rare cases."""
    events = ["--events", "tcp://127.0.0.1:0", "--events-replay", "tcp://127.0.0.1:0",
              "--lookup-events", "tcp://127.0.0.1:0"]
    # A small pool, so 40 turns evict; a short lease, so abandoned work is released soon.
    # One client fills the pool below (no_space): no per-client share (docs/security.md).
    with run_daemon(tmp_path_factory.mktemp("dash"), "--lease-ms", "2000", *events,
                    pool_bytes=8 << 20, env={"KVOFFLOAD_CLIENT_POOL_SHARE_PCT": "100"}) as d:
        out = subprocess.run([sys.executable, "-m", "kvoffload", "demo", "--connect", d.control,
                              "--requests", "40", "--json"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr + out.stdout
        _provoke_rare_outcomes(d.control)
        deadline = time.monotonic() + 60
        while True:  # wait (bounded) for the lease sweeper; nothing here asserts on time
            text = _metrics_text(d.http_url)
            if _value(text, "kvoffload_stores_total", outcome="expired") > 0:
                break
            assert time.monotonic() < deadline, "the abandoned stores were never released"
            time.sleep(0.1)
    samples: dict[str, tuple[str, list[dict[str, str]]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, (fam.type, []))[1].append(dict(s.labels))
    return samples


# -- every name and label the queries use is live ------------------------------------------


def test_queries_were_found() -> None:
    assert len(NAMES) >= 15 and len(SELECTORS) >= 10


@pytest.mark.parametrize("name", NAMES)
def test_metric_is_exported_with_samples(scraped: dict[str, Any], name: str) -> None:
    assert name in scraped, (f"{name} has no sample on /metrics (families without samples "
                             f"need their label values initialized to 0)")
    kind, rows = scraped[name]
    assert rows
    if name.endswith("_total"):
        assert kind == "counter", f"{name} belongs to a {kind}, not a counter"
    elif name.endswith(("_bucket", "_count", "_sum")):
        assert kind in ("histogram", "summary"), f"{name} belongs to a {kind}"
    else:
        assert kind in ("gauge", "info", "untyped"), f"{name} belongs to a {kind}"


@pytest.mark.parametrize(("name", "matchers"), SELECTORS)
def test_selector_labels_occur(scraped: dict[str, Any], name: str, matchers: str) -> None:
    if name not in scraped:  # one failure per cause: test_metric_is_exported_with_samples
        pytest.skip(f"{name} has no samples")
    rows = scraped[name][1]
    for label, op, value in MATCHER_RE.findall(matchers):
        if label in TARGET_LABELS:
            continue
        assert any(label in r for r in rows), f"{name} has no label {label!r}"
        if "$" in value or op in ("!=", "!~"):
            continue  # a variable or a negative matcher pins no value
        want = [r for r in rows if (r.get(label) == value if op == "=" else
                                    re.fullmatch(value, r.get(label, "")))]
        assert want, f"no sample {name}{{{label}{op}{value!r}}}; have {rows}"


def test_aggregation_labels_exist(scraped: dict[str, Any]) -> None:
    for where, query in QUERIES:
        for m in BY_RE.finditer(query):
            labels = {lab.strip() for lab in m.group(1).split(",")} - TARGET_LABELS
            if m.group(2) not in scraped:
                continue  # reported by test_metric_is_exported_with_samples
            rows = scraped[m.group(2)][1]
            for label in labels:
                assert any(label in r for r in rows), f"{where}: {m.group(2)} has no {label!r}"


def test_counters_and_histograms_are_only_read_through_rate_or_increase() -> None:
    for where, query in QUERIES:
        for m in NAME_RE.finditer(query):
            if m.group(0).endswith(("_total", "_bucket", "_sum", "_count")):
                before = query[:m.start()].rstrip()
                assert re.search(r"(rate|increase|irate)\($", before), (
                    f"{where}: {m.group(0)} is a cumulative series; wrap it in rate()/increase()")


# -- the dashboard --------------------------------------------------------------------------


def test_dashboard_is_importable_with_a_datasource_variable() -> None:
    raw = (ROOT / "dashboards/kvoffload.json").read_text()
    assert "__inputs" not in DASHBOARD and "${DS_" not in raw  # no import-time wiring needed
    assert DASHBOARD["title"] and DASHBOARD["uid"] and isinstance(DASHBOARD["schemaVersion"], int)
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for var in variables.values():
        if var["type"] == "query":
            assert var["datasource"]["uid"] == "${datasource}", var["name"]
    used = {v for _, q in QUERIES for v in re.findall(r"\$(\w+)", q)}
    assert used - GRAFANA_BUILTINS <= set(variables), used - GRAFANA_BUILTINS - set(variables)


def test_dashboard_panels_are_well_formed() -> None:
    panels = DASHBOARD["panels"]
    ids = [pn["id"] for pn in panels]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    cells: dict[tuple[int, int], int] = {}
    for pn in panels:
        assert pn["title"] and pn["type"], pn
        g = pn["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and g["h"] > 0 and g["w"] > 0
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, pn["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{pn['title']!r} overlaps panel {cells[(x, y)]}"
                cells[(x, y)] = pn["id"]
        if pn["type"] == "row":
            continue
        assert pn["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, pn["title"]
        assert pn["targets"], pn["title"]
        refs = [t["refId"] for t in pn["targets"]]
        assert len(refs) == len(set(refs)), pn["title"]
        for t in pn["targets"]:
            assert t["expr"].strip(), pn["title"]
            assert t.get("datasource", pn["datasource"])["uid"] == "${datasource}"


def test_dashboard_answers_its_four_questions() -> None:
    rows = [pn["title"] for pn in DASHBOARD["panels"] if pn["type"] == "row"]
    assert rows == ["Is the cache helping?", "Why do requests miss?", "Is it healthy?",
                    "Is it fast?"]
    exprs = " ".join(q for where, q in QUERIES if where.startswith("panel"))
    for needle in ('kind="hit"', 'kind="chunk_hit"', 'kind="tail_hit"', "$prefill_tps",
                   "sum by (reason) (rate(kvoffload_lookup_misses_total",
                   'kvoffload_pool_bytes{state="used"', "kvoffload_evictions_total",
                   "kvoffload_leases_expired_total", "kvoffload_events_dropped_batches_total",
                   "kvoffload_protocol_errors_total",
                   "histogram_quantile(0.99, sum by (le) (rate(kvoffload_lookup_duration"):
        assert needle in exprs, needle


# -- the alert rules ------------------------------------------------------------------------


def test_alert_rules_are_well_formed() -> None:
    names = []
    for group in ALERTS["groups"]:
        assert group["name"] and group["rules"]
        for rule in group["rules"]:
            names.append(rule["alert"])
            assert re.fullmatch(r"[A-Z][A-Za-z0-9]+", rule["alert"])
            assert isinstance(rule["expr"], str) and rule["expr"].strip()
            assert re.fullmatch(r"\d+[smhd]", str(rule["for"])), rule["alert"]
            assert rule["labels"]["severity"] in ("critical", "warning", "info")
            assert rule["annotations"]["summary"].strip()
            assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]
    assert len(names) == len(set(names))


def test_alerts_cover_the_failure_modes() -> None:
    rules = {r["alert"]: r["expr"] for g in ALERTS["groups"] for r in g["rules"]}
    assert any(re.search(r'up\{job="[^"]+"\}\s*==\s*0', e) for e in rules.values())
    assert any("kvoffload_pool_bytes" in e and "kvoffload_evictions_total" in e
               for e in rules.values())
    for metric in ("kvoffload_events_dropped_batches_total", "kvoffload_leases_expired_total",
                   "kvoffload_protocol_errors_total",
                   "vllm:kvoffload_daemon_attached"):  # an engine serving without offload
        assert any(metric in e for e in rules.values()), metric


# -- Kubernetes -----------------------------------------------------------------------------


def _manifests() -> dict[str, list[dict[str, Any]]]:
    by_dir: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                by_dir[path.parent.name].append(doc)
    return by_dir


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    if doc["kind"] == "Pod":
        return doc["spec"]
    if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet"):
        return doc["spec"]["template"]["spec"]
    return None


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def _arg(container: dict[str, Any], flag: str) -> str | None:
    args = [str(a) for a in container.get("command", []) + container.get("args", [])]
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def test_kubernetes_manifests_are_well_formed() -> None:
    manifests = _manifests()
    assert {"sidecar", "daemonset"} <= set(manifests)
    for docs in manifests.values():
        for doc in docs:
            assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"], doc
            spec = _pod_spec(doc)
            if spec is None:
                continue
            volumes = {v["name"] for v in spec.get("volumes", [])}
            for c in _containers(spec):
                assert c["name"] and c["image"], c
                for mount in c.get("volumeMounts", []):
                    assert mount["name"] in volumes, (c["name"], mount["name"])
            if doc["kind"] != "Pod":
                selector = doc["spec"]["selector"]["matchLabels"]
                labels = doc["spec"]["template"]["metadata"]["labels"]
                assert selector.items() <= labels.items(), doc["metadata"]["name"]


def _mounted_at(mounts: dict[str, str], path: str) -> str:
    """The mount path holding ``path`` (the socket may sit in a folder inside a volume)."""
    return max((m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")), key=len)


@pytest.mark.parametrize("variant", ["sidecar", "daemonset"])
def test_kubernetes_variant_wires_vllm_to_the_daemon(variant: str) -> None:
    docs = _manifests()[variant]
    pods = [(d, s) for d in docs if (s := _pod_spec(d)) is not None]
    daemons = [(d, s, c) for d, s in pods for c in _containers(s) if _arg(c, "--control")]
    engines = [(d, s, c) for d, s in pods for c in _containers(s)
               if _arg(c, "--kv-transfer-config")]
    assert len(daemons) == 1 and engines
    ddoc, dspec, daemon = daemons[0]
    control = _arg(daemon, "--control")
    assert control is not None and control.startswith("ipc:///")
    sock_dir = str(Path(control[len("ipc://"):]).parent)
    sock_mount = _mounted_at({m["mountPath"]: m["name"] for m in daemon["volumeMounts"]}, sock_dir)
    pool_dir = str(Path(_arg(daemon, "--pool-path") or Config().pool_path).parent)
    http = _arg(daemon, "--http")
    assert http is not None and http.startswith("0.0.0.0:")  # probes arrive on the pod IP
    ports = {pt["name"]: pt["containerPort"] for pt in daemon["ports"]}
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = daemon[probe]["httpGet"]
        assert get["path"] == path
        assert ports[get["port"]] == int(http.rsplit(":", 1)[1])
    volumes = {v["name"]: v for v in dspec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in daemon["volumeMounts"]}
    pool_volume = volumes[mounts[pool_dir]]
    if variant == "sidecar":
        assert pool_volume["emptyDir"]["medium"] == "Memory"
        assert volumes[mounts[sock_mount]]["emptyDir"]
    else:
        assert ddoc["kind"] == "DaemonSet"
        assert pool_volume["hostPath"]["path"] == "/dev/shm"
        assert volumes[mounts[sock_mount]]["hostPath"]["path"] == sock_dir
    for _, espec, engine in engines:
        cfg = json.loads(_arg(engine, "--kv-transfer-config") or "")
        # Our connector: a load whose slots were reused is recomputed, not a stopped engine.
        assert cfg["kv_connector"] == "KVOffloadConnector" and cfg["kv_role"] == "kv_both"
        assert cfg["kv_connector_module_path"] == "kvoffload.connector.vllm"
        extra = cfg["kv_connector_extra_config"]
        assert extra["spec_name"] == "KVOffloadSpec"
        assert extra["spec_module_path"] == "kvoffload.connector.vllm"
        assert extra["kvoffload_control"] == control
        # The engine sees the socket and the pool file at the daemon's paths.
        emounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
        evolumes = {v["name"]: v for v in espec["volumes"]}
        for path in (sock_mount, pool_dir):
            mine, theirs = evolumes[emounts[path]], volumes[mounts[path]]
            if "hostPath" in theirs:
                assert mine["hostPath"]["path"] == theirs["hostPath"]["path"], path
            else:  # a pod volume: the engine must be in the daemon's pod
                assert espec is dspec and mine is theirs, path


@pytest.mark.parametrize("variant", ["sidecar", "daemonset"])
def test_kubernetes_metrics_are_scraped(variant: str) -> None:
    docs = _manifests()[variant]
    services = [d for d in docs if d["kind"] == "Service"]
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for d in docs
                  if d["kind"] in ("Deployment", "DaemonSet")]
    annotated = [d for d in docs if d["kind"] in ("Deployment", "DaemonSet") and
                 d["spec"]["template"]["metadata"].get("annotations", {})
                 .get("prometheus.io/scrape") == "true"]
    assert annotated
    for monitor in (d for d in docs if d["kind"] == "ServiceMonitor"):
        want = monitor["spec"]["selector"]["matchLabels"]
        svc = [s for s in services if want.items() <= s["metadata"].get("labels", {}).items()]
        assert len(svc) == 1, monitor["metadata"]["name"]
        assert svc[0]["metadata"]["name"] == "kvoffload"  # job="kvoffload" in alerts.yaml
        port_names = {pt["name"] for pt in svc[0]["spec"]["ports"]}
        assert all(ep["port"] in port_names for ep in monitor["spec"]["endpoints"])
        sel = svc[0]["spec"]["selector"]
        assert any(sel.items() <= labels.items() for labels in pod_labels)


# -- systemd --------------------------------------------------------------------------------


def test_systemd_unit() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    unit.read_string((ROOT / "deploy/systemd/kvoffload.service").read_text())
    svc = unit["Service"]
    assert svc["Type"] == "notify" and svc["NotifyAccess"] == "main"
    assert svc["ExecStart"].split() == ["/usr/local/bin/kvoffload", "serve", "--config",
                                        "/etc/kvoffload/kvoffload.toml"]
    assert re.fullmatch(r"\d+(s|min)?", svc["WatchdogSec"])
    assert svc["RuntimeDirectory"] == "kvoffload" and svc["RuntimeDirectoryMode"] == "0700"
    assert svc["Restart"] == "on-failure" and svc["LimitMEMLOCK"] == "infinity"
    assert svc["ProtectSystem"] == "strict" and svc["NoNewPrivileges"] == "yes"
    assert "/dev/shm" in svc["ReadWritePaths"].split()
    # Each of these would take the pool away from the engines or delete it at stop.
    assert svc.get("RemoveIPC", "no") == "no" and svc.get("DynamicUser", "no") == "no"
    assert svc.get("PrivateDevices", "no") == "no"
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_example_config_loads_and_documents_every_key() -> None:
    path = ROOT / "deploy/systemd/kvoffload.toml"
    config = load_config(path, env={})
    # The engines' kvoffload_control and the unit's RuntimeDirectory point at this socket.
    assert config.control == "ipc:///run/kvoffload/control.sock"
    text = path.read_text()
    for field in msgspec.structs.fields(Config):
        assert re.search(rf"^#?{field.name} = ", text, re.M), f"{field.name} is not documented"
