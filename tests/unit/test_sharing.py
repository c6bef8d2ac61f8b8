"""The pure parts of sharing a fleet: lane order, the weighted round robin, names, refusals,
scaling."""

from __future__ import annotations

import pytest

from inferfleet.producer import errors
from inferfleet.producer.connections import refusal
from inferfleet.producer.protocol import QueueKeys, parse_entry
from inferfleet.producer.sharing import (
    PRIORITIES,
    enqueue_keys,
    lane_keys,
    lane_of,
    validate_priority,
    validate_rate,
    validate_tenant,
)
from inferfleet.worker.fleet.scaling import (
    Observation,
    PolicySettings,
    PolicyState,
    desired_workers,
)
from inferfleet.worker.serving.lanes import WEIGHTS, favoured_order, lane_view, pick


def test_the_lanes_are_the_contracts_keys() -> None:
    keys = QueueKeys("ctr")
    assert lane_keys(keys) == (
        "inferfleet:{ctr}:requests:high",
        "inferfleet:{ctr}:requests",
        "inferfleet:{ctr}:requests:low",
    )
    assert lane_of(keys, "normal") == keys.requests
    assert [validate_priority(p) for p in PRIORITIES] == [0, 1, 2]
    assert (
        lane_view(keys, 1) is keys
        and lane_view(keys, 2).requests == "inferfleet:{ctr}:requests:low"
    )
    assert lane_view(keys, 0).reply("r") == keys.reply("r")  # only the stream differs


@pytest.mark.parametrize("priority", ["urgent", "HIGH", "", None, 1])
def test_unknown_priorities_are_refused(priority: object) -> None:
    with pytest.raises(errors.ProtocolError, match="priority must be one of high, normal, low"):
        validate_priority(priority)  # type: ignore[arg-type]


def test_a_cycle_of_reads_favours_each_lane_by_its_weight() -> None:
    cycle = [favoured_order(i)[0] for i in range(sum(WEIGHTS))]
    assert [cycle.count(lane) for lane in range(3)] == list(WEIGHTS) == [8, 3, 1]
    assert (
        favoured_order(0) == (0, 1, 2)
        and favoured_order(8) == (1, 0, 2)
        and favoured_order(11) == (2, 0, 1)
    )
    assert favoured_order(12) == favoured_order(0)


def test_pick_takes_the_favoured_lane_first_and_leaves_the_rest_held() -> None:
    held = [[(b"h1", {}), (b"h2", {})], [(b"n1", {})], [(b"l1", {}), (b"l2", {})]]
    taken, lanes = pick((2, 0, 1), held, 3)
    assert [entry_id for entry_id, _ in taken] == [b"l1", b"l2", b"h1"] and lanes == [2, 2, 0]
    assert held == [[(b"h2", {})], [(b"n1", {})], []]
    assert pick((0, 1, 2), held, 5) == ([(b"h2", {}), (b"n1", {})], [0, 1])


def test_under_saturated_lanes_the_shares_are_the_weights() -> None:
    """Every lane always has more than a read takes: the entries taken follow 8:3:1."""
    counts = [0, 0, 0]
    for read in range(10 * sum(WEIGHTS)):
        held = [[(b"x", {})] * 4 for _ in range(3)]
        _, lanes = pick(favoured_order(read), held, 4)
        for lane in lanes:
            counts[lane] += 1
    assert counts == [10 * 4 * w for w in WEIGHTS]


@pytest.mark.parametrize("tenant", ["a b", "", "x" * 65, "é", "tab\t", "{t}"])
def test_bad_tenants_are_refused(tenant: str) -> None:
    with pytest.raises(errors.ProtocolError, match="tenant must be 1 to 64 characters"):
        validate_tenant(tenant)


def test_tenants_and_rates_that_are_fine() -> None:
    assert validate_tenant("team.ranking:eu@prod-1") == "team.ranking:eu@prod-1"
    assert validate_rate(5, None) == (5.0, 5.0) and validate_rate(0.5, 10) == (0.5, 10.0)


@pytest.mark.parametrize(
    "rate,burst",
    [
        (0, None),
        (-1, None),
        (float("nan"), None),
        (float("inf"), None),
        (1e7, None),
        (1, 0.5),
        (1, -3),
        ("5", None),
    ],
)
def test_bad_rates_are_refused(rate: object, burst: object) -> None:
    with pytest.raises(errors.ProtocolError):
        validate_rate(rate, burst)  # type: ignore[arg-type]


def test_a_hostile_tenant_field_is_a_bad_request() -> None:
    with pytest.raises(errors.ProtocolError, match="tenant") as info:
        parse_entry({b"id": b"r1", b"body": b"x", b"tenant": b"a\x00b"})
    assert info.value.code == "bad_request" and info.value.rid == "r1"  # type: ignore[attr-defined]
    assert parse_entry({b"id": b"r1", b"body": b"x", b"tenant": b"nightly"}).rid == "r1"


def test_the_admission_functions_refusals_become_the_sdks_errors() -> None:
    full = refusal("OVERLOADED 120 100 queue backlog over max_backlog")
    assert (
        isinstance(full, errors.QueueFull)
        and full.backlog == 120
        and "max_backlog 100" in str(full)
    )
    limited = refusal("RATELIMITED 250 nightly over its rate")
    assert isinstance(limited, errors.RateLimited)
    assert limited.tenant == "nightly" and limited.retry_after_s == 0.25
    assert refusal("NOGROUP no such key") is None and refusal("OVERLOADED soon") is None


def test_enqueue_keys_stay_in_the_queues_slot() -> None:
    keys = QueueKeys("ctr")
    assert all("{ctr}" in key for key in enqueue_keys(keys, keys.requests, "nightly"))
    assert (
        enqueue_keys(keys, keys.requests, "")[2] == "inferfleet:{ctr}:limits"
    )  # no tenant: no bucket


def _decide(high_wait_s: float | None, target_s: float) -> int:
    settings = PolicySettings(min_workers=1, max_workers=8, target_high_wait_s=target_s)
    obs = Observation(
        now_s=100.0,
        workers=2,
        lag=0,
        pending=0,
        rate_rps=0.0,
        capacity_rps=1000.0,
        high_wait_s=high_wait_s,
    )
    return desired_workers(obs, settings, PolicyState()).workers


def test_the_high_lanes_wait_scales_up_only_when_a_target_is_set() -> None:
    assert _decide(5.0, 2.0) == 3  # an idle fleet otherwise: the high lane's wait alone adds one
    assert _decide(1.0, 2.0) <= 2 and _decide(5.0, 0.0) <= 2 and _decide(None, 2.0) <= 2


def test_the_high_lanes_wait_must_exceed_its_target_and_an_unknown_wait_is_none() -> None:
    # pinned by the mutation run (issue 35): the boundary, and None read as no wait at all
    assert _decide(2.0, 2.0) <= 2 and _decide(2.1, 2.0) == 3
    assert _decide(None, 0.5) <= 2
    settings = PolicySettings(min_workers=1, max_workers=8, target_high_wait_s=2.0)
    obs = Observation(100.0, 2, 0, 0, 0.0, 1000.0, high_wait_s=5.0)
    reason = desired_workers(obs, settings, PolicyState()).reason
    assert reason.startswith("high lane waited 5.0 s > 2 s; up 1: ")


def test_bad_high_wait_settings_are_refused() -> None:
    with pytest.raises(Exception, match="target_high_wait_s"):
        PolicySettings(target_high_wait_s=-1)
    with pytest.raises(ValueError, match="high_wait_s"):
        Observation(
            now_s=0.0,
            workers=1,
            lag=0,
            pending=0,
            rate_rps=0.0,
            capacity_rps=None,
            high_wait_s=-1.0,
        )


def test_the_tenant_label_is_bounded_to_the_tenants_with_a_quota() -> None:
    from inferfleet.worker.serving.sharing import FleetLimits

    limits = FleetLimits(QueueKeys("q"))
    limits.quota_tenants = {"nightly"}
    assert [limits.label(t) for t in ("nightly", "anyone-else", "")] == ["nightly", "*", "-"]
