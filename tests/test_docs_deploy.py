"""The shipped deployment files are valid for the tools that read them: every Kubernetes manifest
under deploy/kubernetes against the Kubernetes API's schemas (`kubernetes-validate`, offline; the
oldest version docs/operations.md supports, 1.29 for native sidecars, and the newest it ships),
and the systemd unit with `systemd-analyze verify` where systemd is installed.

What the manifests wire together (probes, volumes, the connector config) is checked by
tests/test_dashboards.py; this checks that an API server would take them as written.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").rglob("*.yaml"))
OLDEST = "1.29.0"  # native sidecars (restartPolicy: Always in an init container)
# Custom resources: no schema in kubernetes-validate (the Prometheus Operator ships its CRDs).
NO_SCHEMA = {"ServiceMonitor"}


def _docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((f"{path.relative_to(ROOT)}:{doc['kind']}/{doc['metadata']['name']}",
                            doc))
    return out


DOCS = _docs()


def _validator() -> Any:
    return pytest.importorskip(
        "kubernetes_validate.utils",
        reason="kubernetes-validate is not installed (pip install -e '.[test]')")


def test_every_manifest_is_read() -> None:
    kinds = {doc["kind"] for _, doc in DOCS}
    assert {"Deployment", "DaemonSet", "Service", "ServiceMonitor"} <= kinds


@pytest.mark.parametrize(("name", "doc"), DOCS, ids=[n for n, _ in DOCS])
def test_manifest_is_valid_for_the_kubernetes_api(name: str, doc: dict[str, Any]) -> None:
    kv = _validator()
    if doc["kind"] in NO_SCHEMA:
        pytest.skip(f"{doc['kind']} is a custom resource: kubernetes-validate has no schema")
    for version in (OLDEST, kv.latest_version()):
        # strict: a field the API does not know (a typo) is an error, not silently dropped.
        kv.validate(doc, version, strict=True)


def test_the_validator_would_catch_a_mistake() -> None:
    """The check above can fail: a misspelt field in a real manifest is refused."""
    kv = _validator()
    doc = next(d for _, d in DOCS if d["kind"] == "Deployment")
    bad = copy.deepcopy(doc)
    bad["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, OLDEST, strict=True)


def test_only_known_custom_resources_go_unvalidated() -> None:
    kv = _validator()
    missing = set()
    for _, doc in DOCS:
        try:
            kv.validate(doc, OLDEST, strict=True)
        except kv.SchemaNotFoundError:
            missing.add(doc["kind"])
    assert missing == NO_SCHEMA


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    """`systemd-analyze verify` with the unit's ExecStart pointed at this venv's kvoffload
    (it checks that the command exists): no error and no warning (an unknown key is only a
    warning to systemd, so any output fails)."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed here (no systemd)")
    exe = Path(sys.executable).with_name("kvoffload")
    unit = (ROOT / "deploy" / "systemd" / "kvoffload.service").read_text()
    assert "ExecStart=/usr/local/bin/kvoffload " in unit
    (tmp_path / "kvoffload.service").write_text(
        unit.replace("ExecStart=/usr/local/bin/kvoffload ", f"ExecStart={exe} "))
    out = subprocess.run([tool, "verify", "--man=no", str(tmp_path / "kvoffload.service")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout + out.stderr == "", out.stdout + out.stderr
