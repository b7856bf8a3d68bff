"""Settings: file, then environment, then flags; errors name the key and its source."""

from __future__ import annotations

import pytest
from kvoffload.daemon.config import ConfigError, load_config, parse_size


@pytest.mark.parametrize("text, value", [("1024", 1024), ("64GiB", 64 << 30), ("512M", 512 * 10**6),
                                         ("1.5gib", 3 << 29), (4096, 4096)])
def test_parse_size(text, value) -> None:
    assert parse_size(text) == value


def test_layers_override_in_order(tmp_path) -> None:
    f = tmp_path / "kvoffload.toml"
    f.write_text('pool_bytes = "2GiB"\npolicy = "arc"\nhttp = "0.0.0.0:9000"\n')
    cfg = load_config(f, env={"KVOFFLOAD_POLICY": "lru", "KVOFFLOAD_LEASE_MS": "2500"},
                      flags={"http": "127.0.0.1:1234", "pool_path": None})
    assert cfg.pool_bytes == 2 << 30
    assert cfg.policy == "lru" and cfg.lease_ms == 2500
    assert cfg.http_host_port == ("127.0.0.1", 1234)
    assert cfg.control.startswith("ipc://") and cfg.control.endswith("control.sock")


@pytest.mark.parametrize("kwargs, needle", [
    ({"env": {"KVOFFLOAD_POOL_BYTES": "many"}}, "KVOFFLOAD_POOL_BYTES"),
    ({"env": {"KVOFFLOAD_NOPE": "1"}}, "unknown setting 'nope'"),
    ({"env": {}, "flags": {"lease_ms": 5}}, "lease_ms"),
    ({"env": {}, "flags": {"log_format": "xml"}}, "log_format"),
    ({"env": {"KVOFFLOAD_PREFAULT": "maybe"}}, "'maybe' is not one of 1, true"),
])
def test_errors_name_key_and_source(kwargs, needle) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(**kwargs)
    assert needle in str(exc.value)


def test_bad_file(tmp_path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("pool_bytes = [")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_config(f, env={})


def test_every_boolean_setting_reads_from_the_environment() -> None:
    """Each bool field, not a list of some: ``earmark_reservations`` from the environment
    was refused (Expected `bool`, got `str`)."""
    cfg = load_config(env={"KVOFFLOAD_EARMARK_RESERVATIONS": "false",
                           "KVOFFLOAD_SHARED_INDEX": "0", "KVOFFLOAD_EVENTS_TAILS": "On",
                           "KVOFFLOAD_PREFAULT": "no"})
    assert (cfg.earmark_reservations, cfg.shared_index, cfg.events_tails, cfg.prefault) == (
        False, False, True, False)
    assert load_config(env={}).earmark_reservations is True


def test_engine_events_env_keeps_replay_pairs() -> None:
    cfg = load_config(env={"KVOFFLOAD_ENGINE_EVENTS": "tcp://a:5557,tcp://a:5558; tcp://b:5557"})
    assert cfg.engine_events == ["tcp://a:5557,tcp://a:5558", "tcp://b:5557"]


def _mentioned_variables() -> dict[str, str]:
    """Every complete KVOFFLOAD_* name in the repository's docs, scripts, manifests and code
    (not the tests, which name wrong ones on purpose), with one file that mentions it."""
    import re
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True,
                           check=True).stdout.split()
    found: dict[str, str] = {}
    for rel in files:
        if rel.startswith("tests/") or not (root / rel).is_file():
            continue
        try:
            text = (root / rel).read_text()
        except UnicodeDecodeError:
            continue
        # A name, not a prefix mentioned as such ("KVOFFLOAD_CURVE_*", "KVOFFLOAD_<KEY>").
        for name in re.findall(r"\bKVOFFLOAD_[A-Z0-9_]*[A-Z0-9]\b(?![_<*])", text):
            found.setdefault(name, rel)
    return found


def test_every_variable_the_docs_mention_is_a_setting_or_a_known_switch() -> None:
    """A documented KVOFFLOAD_* name is either a setting or on the list the daemon's loader
    leaves alone; a new switch documented without being listed fails here, not at a user's
    `kvoffload serve`."""
    from kvoffload.daemon.config import _FIELDS, ENV_PREFIX, is_not_setting

    names = _mentioned_variables()
    assert {"KVOFFLOAD_SKIP_VLLM", "KVOFFLOAD_SKIP_APT", "KVOFFLOAD_POOL_BYTES",
            "KVOFFLOAD_ALLOW_UNTESTED_VLLM"} <= set(names)
    neither = {name: where for name, where in names.items()
               if not is_not_setting(name) and name[len(ENV_PREFIX):].lower() not in _FIELDS}
    assert not neither, f"neither a setting nor a listed non-setting: {neither}"


def test_set_up_switches_are_not_settings_and_typos_still_are() -> None:
    switches = {"KVOFFLOAD_SKIP_VLLM": "1", "KVOFFLOAD_SKIP_APT": "1",
                "KVOFFLOAD_SKIP_MOONCAKE": "1", "KVOFFLOAD_SKIP_PROMETHEUS": "1",
                "KVOFFLOAD_ALLOW_UNTESTED_VLLM": "1", "KVOFFLOAD_SKIP_SOMETHING_NEW": "1"}
    cfg = load_config(env={**switches, "KVOFFLOAD_LEASE_MS": "2500"})
    assert cfg.lease_ms == 2500
    # Only the named switches and the SKIP_ prefix are left alone: a misspelt setting is not.
    for typo, key in (("KVOFFLOAD_POOL_BYTE", "pool_byte"), ("KVOFFLOAD_SKIPVLLM", "skipvllm")):
        with pytest.raises(ConfigError, match=f"unknown setting '{key}'"):
            load_config(env={typo: "1"})


def test_the_daemon_starts_with_every_documented_non_setting_set(tmp_path) -> None:
    """`kvoffload serve` as a process, its environment holding every documented variable that
    is not a setting (README tells users to export the set-up switches): it starts, serves."""
    import urllib.request

    from kvoffload.daemon.config import is_not_setting

    from tests.daemon_helpers import run_daemon

    empty = tmp_path / "empty.toml"
    empty.write_text("")
    env = {name: "1" for name in _mentioned_variables() if is_not_setting(name)}
    env["KVOFFLOAD_CONFIG"] = str(empty)  # a path, read by `serve` itself
    env["KVOFFLOAD_BENCH_DIR"] = str(tmp_path)
    env["KVOFFLOAD_DYNAMO_VENV"] = str(tmp_path)
    assert "KVOFFLOAD_SKIP_VLLM" in env and "KVOFFLOAD_ALLOW_UNTESTED_VLLM" in env
    with (run_daemon(tmp_path, env=env) as d,
          urllib.request.urlopen(f"{d.http_url}/readyz", timeout=10) as resp):
        assert resp.status == 200
