"""Sentinel URLs: a primary found through Redis Sentinel, followed across failovers.

``redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/SERVICE[/DB]`` names the
Sentinels (port 26379 unless given), the monitored primary's name and the database;
``rediss+sentinel://`` reaches the primary over TLS. The user and password are the
primary's; the Sentinels' own, where their ACL asks for one, go in the query:
``?sentinel_username=U&sentinel_password=P``. Other query keys are refused by name.

A client built from one (:func:`~inferfleet.producer.connections.connect`) asks the
Sentinels for the primary's address on every new connection (redis-py's Sentinel
support), so after a failover the next connection reaches the new primary, and a
connection still open to a demoted one fails with a ConnectionError instead of writing
to a replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["SENTINEL_SCHEMES", "SentinelURL", "is_sentinel_url", "parse_sentinel_url"]

#: The URL schemes that name a primary through Sentinels (plain, TLS to the primary).
SENTINEL_SCHEMES = ("redis+sentinel://", "rediss+sentinel://")
#: Where a Sentinel listens unless the URL says.
SENTINEL_PORT = 26379
_QUERY_KEYS = ("sentinel_username", "sentinel_password")


@dataclass(frozen=True)
class SentinelURL:
    """What a Sentinel URL names."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    sentinel_username: str | None = None
    sentinel_password: str | None = None


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` names a primary through Sentinels."""
    return url.startswith(SENTINEL_SCHEMES)


def parse_sentinel_url(url: str) -> SentinelURL:
    """The Sentinels, service, database and credentials of ``url`` (ValueError saying what is
    wrong, with the form expected; the password never appears in it)."""
    parts = urlsplit(url)
    form = "redis+sentinel://[:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/SERVICE[/DB]"
    credentials, _, hosts = parts.netloc.rpartition("@")
    path = [p for p in parts.path.split("/") if p]
    if not hosts or not 1 <= len(path) <= 2:
        raise ValueError(f"a Sentinel URL needs its Sentinels and a service name: {form}")
    if len(path) == 2 and not path[1].isdigit():
        raise ValueError(f"the database of a Sentinel URL is a number, got {path[1]!r}: {form}")
    query = parse_qs(parts.query)
    unknown = sorted(set(query) - set(_QUERY_KEYS))
    if unknown:
        raise ValueError(f"unknown Sentinel URL options {unknown}: only {', '.join(_QUERY_KEYS)}")
    username, _, password = credentials.partition(":")
    return SentinelURL(
        sentinels=tuple(_address(one, form) for one in hosts.split(",")),
        service=unquote(path[0]),
        db=int(path[1]) if len(path) == 2 else 0,
        username=unquote(username) or None,
        password=unquote(password) or None,
        tls=parts.scheme == "rediss+sentinel",
        sentinel_username=query.get("sentinel_username", [None])[0],
        sentinel_password=query.get("sentinel_password", [None])[0],
    )


def _address(text: str, form: str) -> tuple[str, int]:
    host, colon, port = text.rpartition(":") if "]" not in text[-1:] else (text, "", "")
    if not colon:
        host, port = text, str(SENTINEL_PORT)
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not a Sentinel's HOST[:PORT]: {form}")
    return host, int(port)
