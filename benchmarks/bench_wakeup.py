"""What one blocking round trip costs the caller's CPU on this machine, back to back and paced.

A floor under every per-call figure of the online path: a call that waits for
Redis sleeps in the kernel and is woken again, and on some virtual machines
that wake-up costs far more CPU than the Python around it. One private
redis-server; ``PING`` with redis-py, ``--requests`` times back to back, then
the same with a sleep of each ``--gaps-ms`` before every call.

    python -m benchmarks.bench_wakeup --requests 2000
"""

from __future__ import annotations

import argparse
import time

import redis

from inferfleet.worker.embedded import EmbeddedRedis


def cpu_us_a_call(client: redis.Redis, requests: int, gap_s: float) -> tuple[float, float]:
    """(client CPU us, wall us) a PING, with ``gap_s`` of sleep before each."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(requests):
        if gap_s:
            time.sleep(gap_s)
        client.ping()
    cpu = (time.process_time() - cpu0) / requests * 1e6
    wall = (time.perf_counter() - wall0) / requests * 1e6 - gap_s * 1e6
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--gaps-ms", default="0,0.1,1,5")
    args = parser.parse_args()
    gaps = [float(part) / 1000 for part in args.gaps_ms.split(",")]
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        cpu_us_a_call(client, 200, 0.0)  # connect and warm up
        print("gap before each PING | client CPU us a PING | round trip us")
        for gap in gaps:
            cpu, wall = cpu_us_a_call(client, args.requests, gap)
            print(f"{gap * 1000:g} ms | {cpu:.1f} | {wall:.1f}")
        client.close()


if __name__ == "__main__":
    main()
