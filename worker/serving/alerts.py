"""The alerts stream ``PREFIX:{NAME}:alerts``: result-check and swap findings.

Workers append one entry per finding (capped per round, so a model that
returns NaN for every request cannot flood Redis); ``inferfleet alerts``
reads them back. The stream is bounded with approximate MAXLEN trimming.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.keys import alerts_key

__all__ = ["ALERTS_MAXLEN", "Alert", "alerts_key", "publish", "read_alerts"]

#: Entries kept in the alerts stream (approximately).
ALERTS_MAXLEN = 10_000
#: Most alerts one worker writes in one round; the rest are summed into one entry.
ROUND_CAP = 20


@dataclass(frozen=True)
class Alert:
    """One alert, as written to and read back from the stream."""

    kind: str
    detail: str
    consumer: str
    version: str
    rid: str = ""
    time_ms: int = 0
    entry_id: str = ""

    def fields(self) -> dict[str, str]:
        """The stream entry's fields (all strings; the time is now if unset)."""
        return {
            "kind": self.kind,
            "detail": self.detail,
            "consumer": self.consumer,
            "version": self.version,
            "id": self.rid,
            "time_ms": str(self.time_ms or int(time.time() * 1000)),
        }

    @classmethod
    def from_entry(cls, entry_id: bytes, raw: dict[bytes, bytes]) -> Alert:
        """Parse one entry of the alerts stream; a corrupt time reads as 0."""
        d = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in raw.items()}
        try:
            time_ms = int(d.get("time_ms", "0"))
        except ValueError:
            time_ms = 0
        return cls(
            d.get("kind", "?"),
            d.get("detail", ""),
            d.get("consumer", "?"),
            d.get("version", "?"),
            d.get("id", ""),
            time_ms,
            entry_id.decode(),
        )


def capped(alerts: Sequence[Alert]) -> list[Alert]:
    """At most :data:`ROUND_CAP` alerts, the overflow summed into the last one."""
    if len(alerts) <= ROUND_CAP:
        return list(alerts)
    kept = list(alerts[: ROUND_CAP - 1])
    rest = alerts[ROUND_CAP - 1 :]
    kinds = sorted({a.kind for a in rest})
    last = rest[0]
    kept.append(
        Alert(
            last.kind if len(kinds) == 1 else "many",
            f"{len(rest)} more alerts in one round ({', '.join(kinds)}); first: {last.detail}",
            last.consumer,
            last.version,
            last.rid,
        )
    )
    return kept


def publish(client: redis.Redis, keys: QueueKeys, alerts: Sequence[Alert]) -> None:
    """Append the alerts (capped) in one pipeline."""
    if not alerts:
        return
    pipe = client.pipeline(transaction=False)
    for alert in capped(alerts):
        pipe.xadd(alerts_key(keys), alert.fields(), maxlen=ALERTS_MAXLEN, approximate=True)
    pipe.execute()


def read_alerts(
    client: redis.Redis, keys: QueueKeys, count: int = 20, kind: str | None = None
) -> list[Alert]:
    """The newest ``count`` alerts (of ``kind``, if given), oldest first."""
    found: list[Alert] = []
    last = "+"
    while len(found) < count:
        batch = client.xrevrange(alerts_key(keys), max=last, min="-", count=max(count, 100))
        if not batch:
            break
        for entry_id, raw in batch:
            alert = Alert.from_entry(entry_id, raw)
            if kind is None or alert.kind == kind:
                found.append(alert)
        last = "(" + batch[-1][0].decode()
        if len(batch) < max(count, 100):
            break
    return list(reversed(found[:count]))
