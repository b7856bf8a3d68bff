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


def test_engine_events_env_keeps_replay_pairs() -> None:
    cfg = load_config(env={"KVOFFLOAD_ENGINE_EVENTS": "tcp://a:5557,tcp://a:5558; tcp://b:5557"})
    assert cfg.engine_events == ["tcp://a:5557,tcp://a:5558", "tcp://b:5557"]
