"""Nothing lost, nothing answered twice: the chaos scenarios of benchmarks/chaos.py, asserted.

Each scenario runs real supervisors, workers and redis-servers of its own.
They are slow (10-30 s each) and run in CI with the rest of the suite.
"""

from __future__ import annotations

import pytest

from benchmarks.chaos import (
    scenario_cluster,
    scenario_failover,
    scenario_kill,
    scenario_poison,
    scenario_redis,
    scenario_swap,
    scenario_switchover,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def assert_all_answered_once(result: dict) -> None:
    assert result["lost"] == 0, result
    assert result["unacknowledged"] == 0, (
        result
    )  # else a duplicate could still come: the count is not final
    assert result["duplicated"] == 0, result
    assert result["wrong"] == 0, result
    assert result["answered"] == result["requests"], result


def test_sigkill_a_random_worker_every_second_loses_nothing():
    result = scenario_kill(requests=5000, workers=3, kill_every_s=1.0)
    assert result["kills"] >= 3, result
    assert_all_answered_once(result)
    assert result["dead_lettered"] == 0, result


def test_redis_crash_and_restart_with_aof_loses_no_accepted_request():
    result = scenario_redis(requests=3000, workers=2, down_s=1.0)
    assert_all_answered_once(result)
    assert result["dead_lettered"] == 0, result


def test_a_request_that_kills_its_worker_is_dead_lettered_while_others_flow():
    result = scenario_poison(requests=1000, workers=2)
    assert result["poison_code"] == "dead_letter", result
    assert result["dead_letters"] == 1, result  # only the poison: its batch-mates were answered
    assert_all_answered_once(result)
    assert result["dead_lettered"] == 0, result


def test_hot_swaps_while_workers_are_killed_lose_nothing_and_name_their_version():
    result = scenario_swap(requests=4000, workers=3, kill_every_s=1.0)
    assert result["swaps"] == 3 and result["kills"] >= 3, result
    assert_all_answered_once(result)  # "wrong" counts outputs that are not the named version's
    assert result["dead_lettered"] == 0, result
    assert result["sim-1"] > 0 and result["sim-2"] > 0, result


@pytest.mark.parametrize("planned", [False, True], ids=["killed", "switched-over"])
def test_a_primary_behind_sentinels_is_followed_and_what_it_loses_is_only_counted(planned):
    """Without durability (replication is asynchronous) a SIGKILLed primary may take accepted
    requests with it, and a switched-over one takes what it accepts until it is demoted:
    docs/reliability.md reports how many. What must hold: the fleet and the producers follow
    the promoted replica without a restart, nothing stays pending, and no reply is wrong."""
    if planned:
        result = scenario_switchover(requests=2000, workers=2)
    else:
        result = scenario_failover(requests=2000, workers=2)
    # the scenario bounds the promotion (TimeoutError) and returns only once a new request
    # was answered through the Sentinels: their times are figures, not what a test checks
    assert result["unacknowledged"] == 0, result
    assert result["wrong"] == 0 and result["dead_lettered"] == 0, result
    assert result["answered"] + result["lost"] == result["requests"] > 0, result


@pytest.mark.parametrize("planned", [False, True], ids=["killed", "switched-over"])
def test_with_durability_a_failover_loses_no_accepted_request(planned):
    """Producers (the SDK and a raw-redis one) WAIT for every replica, workers too: every
    request a producer was told was accepted is answered once, whether the primary was
    SIGKILLed (and restarted, to rejoin as a replica) or switched over (with two replicas);
    what was not confirmed in time was refused, never silently dropped."""
    if planned:  # two replicas: durability waits for both (one could drop what it confirmed)
        result = scenario_switchover(requests=1200, workers=2, durable=True, replicas=2)
    else:
        result = scenario_failover(requests=1200, workers=2, durable=True)
    assert_all_answered_once(result)
    assert result["failovers"] == 1, result
    if planned:  # the new primary lacks a replica until the Sentinels demote the old one
        assert result["not_accepted"] > 0, result


@pytest.mark.parametrize("durable", [False, True], ids=["async", "durable"])
def test_a_cluster_master_killed_is_followed_by_the_fleet_and_the_producer(durable):
    """A Redis Cluster with a replica per master: the master of the queue's slot is SIGKILLed;
    the fleet and the producer follow the promoted replica. With durability nothing accepted is
    lost; without it what is lost is only counted."""
    result = scenario_cluster(requests=1200, workers=2, durable=durable)
    assert result["unacknowledged"] == 0 and result["wrong"] == 0, result
    if durable:
        assert_all_answered_once(result)
    else:
        assert result["answered"] + result["lost"] == result["requests"] > 0, result
