"""Sentinel URLs (producer/sentinel.py): what one names, and what a malformed one is told."""

from __future__ import annotations

import re

import pytest

from inferfleet.producer.connections import connect
from inferfleet.producer.sentinel import parse_sentinel_url


def test_a_sentinel_url_is_parsed_with_its_defaults_and_refused_when_malformed() -> None:
    target = parse_sentinel_url("rediss+sentinel://u:p%40ss@h1,h2:26380/main/3?sentinel_password=s")
    assert target.sentinels == (("h1", 26379), ("h2", 26380))
    assert (target.service, target.db, target.username, target.password) == ("main", 3, "u", "p@ss")
    assert target.tls and target.sentinel_password == "s"
    for bad, says in [
        ("redis+sentinel://h1:26379", "a service name"),
        ("redis+sentinel://h1:x/main", "not a Sentinel's HOST[:PORT]"),
        ("redis+sentinel://h1/main/zero", "is a number"),
        ("redis+sentinel://h1/main?ssl=1", "unknown Sentinel URL options ['ssl']"),
    ]:
        with pytest.raises(ValueError, match=re.escape(says)):
            parse_sentinel_url(bad)


def test_a_sentinel_url_with_cluster_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match="drop --cluster"):
        connect("redis+sentinel://h1/main/0", cluster=True)


def test_a_sentinel_url_never_shows_its_password_in_an_error() -> None:
    with pytest.raises(ValueError) as caught:
        parse_sentinel_url("redis+sentinel://:hunter2@h1:x/main")
    assert "hunter2" not in str(caught.value)


def test_the_cli_cuts_redis_pys_client_repr_and_says_what_to_check() -> None:
    from inferfleet.worker.cli.group import with_hint

    raw = (
        "Redis error: No master found for 'mymaster' : <redis.client.Redis(<redis.connection."
        "ConnectionPool(<redis.connection.Connection(db=0,host=127.0.0.1,port=1)>)>)> - "
        "network:ConnectionError: Error 111 connecting to 127.0.0.1:1. Connection refused."
    )
    shown = with_hint(raw)
    assert "<redis.client" not in shown and "No master found for 'mymaster'" in shown
    assert "Connection refused" in shown and "are the Sentinels of the URL reachable" in shown
