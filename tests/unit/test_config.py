"""inferfleet.worker.config.WorkerSettings: defaults, validation messages, environment names."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, fields
from typing import Any

import pytest

from inferfleet.producer.protocol import DEFAULT_PREFIX, DEFAULT_REPLY_TTL_S, Limits
from inferfleet.worker.config import DEVICE_CHOICES, ENV_VARS, WorkerSettings, default_consumer_name
from inferfleet.worker.errors import ConfigError, WorkerError


def settings(**overrides: Any) -> WorkerSettings:
    values: dict[str, Any] = {"name": "ctr", "model": "models/ctr.pt", "consumer": "host-1"}
    values.update(overrides)
    return WorkerSettings(**values)


def test_defaults_are_valid() -> None:
    s = WorkerSettings(name="ctr", model="models/ctr.pt")
    assert s.prefix == DEFAULT_PREFIX
    assert s.device == "auto"
    assert s.max_batch_rows == 64
    assert s.max_wait_ms == 5.0
    assert s.max_wait_s == pytest.approx(0.005)
    assert s.reply_ttl_s == DEFAULT_REPLY_TTL_S
    assert s.consumer == default_consumer_name()
    assert s.limits == Limits(max_body_bytes=s.max_body_bytes)


def test_settings_are_frozen() -> None:
    s = settings()
    with pytest.raises(FrozenInstanceError):
        s.max_batch_rows = 3  # type: ignore[misc]


def test_redis_url_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://example:6390/2")
    assert settings().redis_url == "redis://example:6390/2"
    monkeypatch.delenv("REDIS_URL")
    assert settings().redis_url == "redis://localhost:6379/0"


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:15"])
def test_valid_devices(device: str) -> None:
    assert settings(device=device).device == device


@pytest.mark.parametrize(
    "device", ["gpu", "CPU", "cuda:", "cuda:x", "cuda:1234", "mps", "", "cpu "]
)
def test_bad_device_names_the_allowed_values(device: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings(device=device)
    assert "device" in str(info.value)
    assert DEVICE_CHOICES in str(info.value)


@pytest.mark.parametrize("name", ["", "a b", "x" * 65, "a{b}", "é"])
def test_bad_queue_name_names_the_field_and_charset(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings(name=name)
    assert "name" in str(info.value)
    assert "A-Z a-z 0-9 . _ -" in str(info.value)


def test_bad_prefix_is_config_error() -> None:
    with pytest.raises(ConfigError, match="prefix"):
        settings(prefix="has space")


def test_missing_model_is_config_error() -> None:
    with pytest.raises(ConfigError, match="model"):
        settings(model="")


@pytest.mark.parametrize("consumer", ["", "a b", "x" * 129, "a/b", "é"])
def test_bad_consumer_name_is_config_error(consumer: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings(consumer=consumer)
    assert "consumer" in str(info.value)
    assert "A-Z a-z 0-9" in str(info.value)


def test_consumer_names_with_host_punctuation_are_valid() -> None:
    assert settings(consumer="worker@node-1.local:42").consumer == "worker@node-1.local:42"


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_batch_rows", 0),
        ("max_batch_rows", -1),
        ("max_batch_rows", (1 << 20) + 1),
        ("max_batch_rows", True),
        ("max_batch_rows", "8"),
        ("max_wait_ms", -0.1),
        ("max_wait_ms", -5),
        ("max_wait_ms", 60_001),
        ("warmup_iters", -1),
        ("torch_threads", 0),
        ("reply_ttl_s", 0),
        ("max_body_bytes", 63),
        ("idle_block_ms", 0),
        ("claim_idle_s", 0.0),
        ("housekeeping_s", 0.0),
    ],
)
def test_out_of_range_values_name_the_field_and_the_range(field: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        settings(**{field: value})
    message = str(info.value)
    assert field in message
    assert "must be a number from" in message
    assert repr(value) in message


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_batch_rows", 1),
        ("max_batch_rows", 1 << 20),
        ("max_wait_ms", 0),
        ("max_wait_ms", 0.5),
        ("warmup_iters", 0),
        ("max_body_bytes", 64),
    ],
)
def test_range_bounds_are_inclusive(field: str, value: Any) -> None:
    assert getattr(settings(**{field: value}), field) == value


def test_config_error_is_a_worker_error_and_a_value_error() -> None:
    with pytest.raises(ConfigError) as info:
        settings(max_batch_rows=0)
    assert isinstance(info.value, WorkerError)
    assert isinstance(info.value, ValueError)


def test_limits_follow_max_body_bytes() -> None:
    assert settings(max_body_bytes=1024).limits.max_body_bytes == 1024


def test_env_vars_map_every_field() -> None:
    names = {f.name for f in fields(WorkerSettings)}
    assert set(ENV_VARS) == names
    assert ENV_VARS["redis_url"] == "REDIS_URL"
    for name in names - {"redis_url"}:
        assert ENV_VARS[name] == f"INFERFLEET_{name.upper()}"
    assert ENV_VARS["max_batch_rows"] == "INFERFLEET_MAX_BATCH_ROWS"
    assert len(set(ENV_VARS.values())) == len(ENV_VARS)


def test_the_fleet_cache_needs_the_local_one() -> None:
    with pytest.raises(ConfigError, match="fleet_cache_ttl_s needs cache_size"):
        WorkerSettings(name="q", model="m.pt", fleet_cache_ttl_s=60)
    assert (
        WorkerSettings(
            name="q", model="m.pt", fleet_cache_ttl_s=60, cache_size=10
        ).fleet_cache_ttl_s
        == 60
    )


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "127.0.0.1", "::1", "10.1.2.3"])
def test_metrics_address_takes_an_ip_address(address: str) -> None:
    assert settings(metrics_address=address).metrics_address == address


@pytest.mark.parametrize("address", ["", "localhost", "0.0.0.0:9100", "256.1.1.1", "*"])
def test_a_bad_metrics_address_says_what_is_expected(address: str) -> None:
    with pytest.raises(ConfigError, match=r"metrics_address .* is not an IP address"):
        settings(metrics_address=address)
