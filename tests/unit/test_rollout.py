"""The shadow hash as workers read it, and the even sampling of batches (no Redis)."""

from __future__ import annotations

from inferfleet.worker.serving.comparison import Thresholds
from inferfleet.worker.serving.rollout import Candidate
from inferfleet.worker.serving.shadow import EvenShare


def test_the_shadow_hash_parses_clamps_and_refuses_corruption() -> None:
    raw = {
        b"model": b"m.pt",
        b"version": b"v2",
        b"seq": b"7",
        b"state": b"canary",
        b"sample": b"3",
        b"canary": b"250",
        b"min_compared": b"5",
    }
    cand = Candidate.from_hash(raw)
    assert cand is not None and cand.active and (cand.sample, cand.canary) == (1.0, 100.0)
    assert cand.thresholds == Thresholds(min_compared=5)
    assert Candidate.from_hash({**raw, b"seq": b"x"}) is None
    assert Candidate.from_hash({b"model": b"m.pt"}) is None
    assert not Candidate.from_hash({**raw, b"state": b"rolled_back"}).active


def test_a_share_of_calls_is_picked_evenly() -> None:
    credit = EvenShare()
    picks = [credit.due(0.25) for _ in range(12)]
    assert picks == [False, False, False, True] * 3
    tenth = EvenShare()
    assert sum(tenth.due(0.1) for _ in range(1000)) == 100
