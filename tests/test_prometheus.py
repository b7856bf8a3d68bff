"""A real Prometheus (Debian's 2.42 package, with promtool) against a live daemon.

Prometheus scrapes the daemon every second while a short demo runs; then every dashboard
panel query and query variable is evaluated through Prometheus's HTTP API and must return
data, and every alert rule is loaded, evaluated by Prometheus without error, and each of its
selectors has series. ``promtool check rules`` checks alerts.yaml, and ``promtool test
rules`` runs dashboards/alerts_test.yaml, in which every alert has a case that fires and one
that does not (and inverting the expectations must fail every case).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.daemon_helpers import run_daemon
from tests.test_dashboards import ALERTS, DASHBOARD, _provoke_rare_outcomes

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
_WHY = ("Debian's prometheus package is not installed (scripts/setup.sh installs it where "
        "apt-get is available; it includes promtool)")
needs_prometheus = pytest.mark.skipif(not (PROMETHEUS and PROMTOOL), reason=_WHY)

# The daemon's series (vllm:kvoffload_* are vLLM engines': none here, the alert still loads).
SELECTOR_RE = re.compile(r"(?<!vllm:)\b((?:kvoffload_[a-z0-9_]+|up))(\{[^}]*\})?")
# Grafana's variables as the board uses them; $__rate_interval spans >= 4 scrapes here.
GRAFANA = {"$__rate_interval": "30s", "$__range": "5m", "$__interval": "1s",
           "$job": "kvoffload", "$instance": ".*", "$prefill_tps": "10000"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _grafana(expr: str) -> str:
    for var, value in sorted(GRAFANA.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
    return expr


class Prom:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> Any:
        qs = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{qs}", timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] in ("vector", "scalar"), data
        return data["result"] if data["resultType"] == "vector" else [{"value": data["result"]}]

    def value(self, expr: str) -> float:
        rows = self.query(expr)
        return float(rows[0]["value"][1]) if rows else float("nan")


def _wait(cond: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def prom(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prom]:
    if not (PROMETHEUS and PROMTOOL):
        pytest.skip(_WHY)
    tmp = tmp_path_factory.mktemp("prom")
    events = ["--events", "tcp://127.0.0.1:0", "--events-replay", "tcp://127.0.0.1:0",
              "--lookup-events", "tcp://127.0.0.1:0"]  # the event panels need publishers
    # One client fills the pool (no_space): no per-client share (docs/security.md).
    with run_daemon(tmp, "--lease-ms", "2000", *events, pool_bytes=8 << 20,
                    env={"KVOFFLOAD_CLIENT_POOL_SHARE_PCT": "100"}) as d:
        target = d.http_url.removeprefix("http://")
        conf = tmp / "prometheus.yml"
        conf.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ROOT / "dashboards/alerts.yaml")],
            "scrape_configs": [{"job_name": "kvoffload",
                                "static_configs": [{"targets": [target]}]}]}))
        port = _free_port()
        log = (tmp / "prometheus.log").open("wb")
        proc = subprocess.Popen([PROMETHEUS, f"--config.file={conf}",
                                 f"--storage.tsdb.path={tmp / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
        p = Prom(f"http://127.0.0.1:{port}")
        try:
            def up() -> bool:
                assert proc.poll() is None, (tmp / "prometheus.log").read_text()[-3000:]
                try:
                    return p.value('up{job="kvoffload"}') == 1
                except OSError:
                    return False
            _wait(up, "the first scrape")
            # The demo runs while Prometheus scrapes.
            out = subprocess.run([sys.executable, "-m", "kvoffload", "demo", "--connect",
                                  d.control, "--requests", "60", "--json"],
                                 capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr + out.stdout
            _provoke_rare_outcomes(d.control)
            _wait(lambda: p.value('sum(kvoffload_stores_total{outcome="expired"})') > 0,
                  "the abandoned stores to be released and scraped")
            # A few more scrapes, so every rate() window holds the demo's increase.
            seen = p.value('count_over_time(up{job="kvoffload"}[5m])')
            _wait(lambda: p.value('count_over_time(up{job="kvoffload"}[5m])') >= seen + 4,
                  "four more scrapes")
            yield p
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()


def _panel_queries() -> list[tuple[str, str]]:
    return [(f"{panel['title']} [{t.get('refId', i)}]", t["expr"])
            for panel in DASHBOARD["panels"] for i, t in enumerate(panel.get("targets", []))]


PANELS = _panel_queries()
RULES = [(r["alert"], r["expr"]) for g in ALERTS["groups"] for r in g["rules"]]


@needs_prometheus
@pytest.mark.parametrize(("panel", "expr"), PANELS, ids=[p for p, _ in PANELS])
def test_panel_query_returns_data(prom: Prom, panel: str, expr: str) -> None:
    rows = prom.query(_grafana(expr))
    assert rows, f"panel {panel!r}: no data for {_grafana(expr)}"


@needs_prometheus
def test_hit_panels_show_the_demo(prom: Prom) -> None:
    # Not just "some series": the demo's hits reached Prometheus.
    hit = prom.value(_grafana('sum(increase(kvoffload_lookup_tokens_total{kind="hit", '
                              'job=~"$job", instance=~"$instance"}[$__range]))'))
    assert hit > 0


@needs_prometheus
def test_query_variables_have_values(prom: Prom) -> None:
    variables = [v for v in DASHBOARD["templating"]["list"] if v["type"] == "query"]
    assert {v["name"] for v in variables} >= {"job", "instance"}
    for var in variables:
        q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", _grafana(q))
        assert m, f"variable {var['name']}: {q} is not label_values(SELECTOR, LABEL)"
        values = prom.get(f"/api/v1/label/{m.group(2)}/values", **{"match[]": m.group(1)})
        assert values, f"variable {var['name']}: no values for {q}"


@needs_prometheus
@pytest.mark.parametrize(("alert", "expr"), RULES, ids=[a for a, _ in RULES])
def test_alert_expression_is_evaluated_and_its_series_exist(prom: Prom, alert: str,
                                                            expr: str) -> None:
    prom.query(expr)  # a valid PromQL expression for Prometheus itself (empty: not firing)
    rules = {r["name"]: r for g in prom.get("/api/v1/rules")["groups"] for r in g["rules"]}
    assert alert in rules, f"Prometheus did not load {alert}"
    _wait(lambda: prom.get("/api/v1/rules")["groups"] and any(
        r["name"] == alert and r.get("lastEvaluation", "").startswith("20")
        for g in prom.get("/api/v1/rules")["groups"] for r in g["rules"]), "an evaluation")
    rule = next(r for g in prom.get("/api/v1/rules")["groups"] for r in g["rules"]
                if r["name"] == alert)
    assert rule["health"] == "ok" and not rule.get("lastError"), rule
    for m in SELECTOR_RE.finditer(expr):
        selector = m.group(1) + (m.group(2) or "")
        assert prom.query(selector), f"{alert}: no series for {selector}"


@needs_prometheus
def test_promtool_check_rules() -> None:
    assert PROMTOOL is not None
    out = subprocess.run([PROMTOOL, "check", "rules", str(ROOT / "dashboards/alerts.yaml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(RULES)} rules found" in out.stdout


def _unit_dir(tmp_path: Path, tests: dict[str, Any]) -> Path:
    """alerts.yaml without annotations (promtool compares them verbatim) + the tests."""
    rules = yaml.safe_load((ROOT / "dashboards/alerts.yaml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "alerts.yaml").write_text(yaml.safe_dump(rules))
    (tmp_path / "alerts_test.yaml").write_text(yaml.safe_dump(tests))
    return tmp_path / "alerts_test.yaml"


UNIT = yaml.safe_load((ROOT / "dashboards/alerts_test.yaml").read_text())


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    fires: dict[str, int] = {}
    quiet: dict[str, int] = {}
    for case in UNIT["tests"]:
        for t in case["alert_rule_test"]:
            (fires if t["exp_alerts"] else quiet)[t["alertname"]] = 1
    names = {a for a, _ in RULES}
    assert names - set(fires) == set() and names - set(quiet) == set()


@needs_prometheus
def test_promtool_unit_tests_pass_and_each_case_discriminates(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    (tmp_path / "ok").mkdir()
    ok = subprocess.run([PROMTOOL, "test", "rules", str(_unit_dir(tmp_path / "ok", UNIT))],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # Invert every expectation: each of the cases must now fail, so none passes vacuously.
    inverted = json.loads(json.dumps(UNIT))
    n = 0
    for case in inverted["tests"]:
        for t in case["alert_rule_test"]:
            t["exp_alerts"] = [] if t["exp_alerts"] else [{"exp_labels": {"severity": "x"}}]
            n += 1
    (tmp_path / "inv").mkdir()
    bad = subprocess.run([PROMTOOL, "test", "rules", str(_unit_dir(tmp_path / "inv", inverted))],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0
    assert (bad.stdout + bad.stderr).count("alertname:") == n
