"""The tiny generative model's key-value cache against recomputation (issue 34).

Greedy generation through the cache (prefill, then one step at a time, slots joining and
leaving) must give the tokens that :meth:`TinyLM.reference_generate` gives by recomputing the
whole sequence every token; a batched step must give each slot the logits it gets alone; the
fused pass (``extend``: prompts started beside live sequences' tokens, packed) must give what
prefill and step give; bad calls raise ValueError and change nothing; two builds give the same
weights.

The model is untrained (seeded weights, no step): building it takes no time, and its greedy
outputs still differ from prompt to prompt, their top two logits at least 0.01 apart (float
error is 1e-6). Every cached step's logits are also checked against a full pass over the
sequence: planted cache bugs (a key written one position off, a mask one position short or
too long, slots' keys swapped, positions not advanced) each failed a test, with this model
as with one trained for 60 steps.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from inferfleet.worker.runtime.stepwise import StepwiseHandler
from tests.fixtures import build_models, tiny_lm
from tests.fixtures.tiny_lm import EOS, VOCAB_SIZE, TinyLM, build_tiny_lm, encode

MAX_LENGTH = 48
MAX_NEW = 24
PROMPTS = ["#", "The worker ", "Redis Streams carry the requests", "a", "pip install -e"]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Torch on one thread: tensors this small made two threads on two busy cores 25x slower
    (their hand-offs wait for the neighbours' processes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def lm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tinylm") / "tinylm.pt"
    build_tiny_lm(path, steps=0)
    return path


def loaded(path: Path, max_slots: int = 4, max_length: int = MAX_LENGTH) -> TinyLM:
    lm = TinyLM(path=path, max_slots=max_slots, max_length=max_length)
    lm.setup(torch.device("cpu"))
    return lm


@pytest.fixture
def lm(lm_path: Path) -> TinyLM:
    return loaded(lm_path)


class Greedy:
    """Greedy decoding through the cache, per slot, with reference_generate's stopping rule;
    every step's logits checked against a full pass over the slot's whole sequence."""

    def __init__(self, lm: TinyLM) -> None:
        self.lm = lm
        self.sequence: dict[int, list[int]] = {}
        self.generated: dict[int, list[int]] = {}

    def start(self, slots: list[int], prompts: list[str]) -> None:
        arrays = [encode(p) for p in prompts]
        logits = self.lm.prefill(slots, arrays)
        for slot, array, row in zip(slots, arrays, logits):
            self.sequence[slot] = list(array)
            self.generated[slot] = []
            self._take(slot, row)

    def _take(self, slot: int, row: np.ndarray) -> None:
        net = self.lm.net
        assert net is not None
        with torch.inference_mode():
            hidden, _, _ = net(torch.tensor([self.sequence[slot]]))
            full = net.logits(hidden[0, -1]).numpy()
        np.testing.assert_allclose(row, full, rtol=1e-4, atol=1e-4)
        token = int(np.argmax(row))
        self.sequence[slot].append(token)
        self.generated[slot].append(token)

    def done(self, slot: int) -> bool:
        out = self.generated[slot]
        full = len(self.sequence[slot]) >= self.lm.max_length
        return out[-1] == EOS or len(out) >= MAX_NEW or full

    def advance(self, slots: list[int]) -> None:
        """One step of those of ``slots`` not done, in the order given."""
        live = [s for s in slots if not self.done(s)]
        if live:
            tokens = np.array([self.sequence[s][-1] for s in live], dtype=np.int64)
            for slot, row in zip(live, self.lm.step(live, tokens)):
                self._take(slot, row)

    def fused(self, starting: dict[int, str], slots: list[int]) -> None:
        """One ``extend`` pass: the ``starting`` slots from their prompts, then those of
        ``slots`` not done one token, the rows interleaved (started ones at odd places)."""
        live = [s for s in slots if not self.done(s)]
        rows: list[tuple[int, np.ndarray, bool]] = [
            (s, np.array(self.sequence[s][-1:], np.int64), False) for s in live
        ]
        for place, (slot, prompt) in enumerate(starting.items()):
            rows.insert(min(2 * place + 1, len(rows)), (slot, encode(prompt), True))
        logits = self.lm.extend([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
        for (slot, array, start), row in zip(rows, logits):
            if start:
                self.sequence[slot], self.generated[slot] = list(array), []
            self._take(slot, row)

    def finish(self, slots: list[int]) -> None:
        while any(not self.done(s) for s in slots):
            self.advance(slots)


def reference(lm: TinyLM, prompt: str) -> list[int]:
    return lm.reference_generate(encode(prompt), MAX_NEW).tolist()


def test_cached_generation_of_a_batch_equals_recomputation(lm_path: Path) -> None:
    lm = loaded(lm_path, max_slots=len(PROMPTS))
    run = Greedy(lm)
    slots = list(range(len(PROMPTS)))
    run.start(slots, PROMPTS)
    run.finish(slots)
    expected = [reference(lm, p) for p in PROMPTS]
    assert [run.generated[s] for s in slots] == expected
    assert len({tuple(e) for e in expected}) > 1, "every prompt gave one output: a vacuous test"
    # "Redis Streams carry the requests" (32 bytes) reaches max_length: it stops there
    assert len(expected[2]) == MAX_LENGTH - len(PROMPTS[2])


def test_slots_join_and_leave_mid_generation(lm: TinyLM) -> None:
    run = Greedy(lm)
    run.start([0], [PROMPTS[1]])
    for _ in range(3):
        run.advance([0])
    run.start([1], [PROMPTS[4]])
    for _ in range(2):
        run.advance([1, 0])
    # slot 2 joins while slot 0 is 5 steps in and slot 1 is 2 steps in
    run.start([2], [PROMPTS[0]])
    for _ in range(4):
        run.advance([2, 0, 1])
    # slot 0 leaves unfinished; a new sequence takes it while the others go on
    partial = run.generated[0]
    lm.release(0)
    assert lm.length(0) == 0
    run.start([0], [PROMPTS[3]])
    run.advance([1])  # a step for a subset of the live slots
    run.advance([0, 2])
    run.finish([0, 1, 2])
    assert partial == reference(lm, PROMPTS[1])[: len(partial)]
    for slot, prompt in ((0, PROMPTS[3]), (1, PROMPTS[4]), (2, PROMPTS[0])):
        assert run.generated[slot] == reference(lm, prompt), prompt


def test_a_batched_step_gives_each_slot_its_logits_alone(lm_path: Path) -> None:
    batched, alone = loaded(lm_path), loaded(lm_path)
    prompts = [encode(p) for p in PROMPTS[1:4]]
    together = batched.prefill([0, 1, 2], prompts)
    # alone: each prompt in another slot number, one slot a call
    singles = {s: alone.prefill([s], [p])[0] for s, p in zip((3, 0, 1), prompts)}
    np.testing.assert_allclose(together, np.stack(list(singles.values())), rtol=1e-5, atol=1e-5)
    rng = np.random.default_rng(0)
    for _ in range(5):
        tokens = rng.integers(0, VOCAB_SIZE, size=3, dtype=np.int64)
        got = batched.step([2, 0, 1], tokens[[2, 0, 1]])[[1, 2, 0]]
        want = [alone.step([s], tokens[[i]])[0] for i, s in enumerate((3, 0, 1))]
        np.testing.assert_allclose(got, np.stack(want), rtol=1e-5, atol=1e-5)


def test_fused_passes_generate_what_recomputation_generates(lm_path: Path) -> None:
    """Slots start in passes that step live ones (prompts of 1 to 32 tokens, several at once,
    at odd places among the rows); every pass's logits equal a full pass over each sequence
    (Greedy._take) and every greedy output the recomputation's."""
    lm = loaded(lm_path, max_slots=5)
    run = Greedy(lm)
    run.fused({2: PROMPTS[1]}, [])
    run.fused({}, [2])
    run.fused({0: PROMPTS[2], 4: PROMPTS[0]}, [2])
    run.fused({3: PROMPTS[3], 1: PROMPTS[4]}, [4, 2, 0])
    for _ in range(3):
        run.fused({}, [0, 1, 2, 3, 4])
    lm.release(2)
    run.fused({2: "Continuous"}, [1, 3, 0, 4])
    while any(not run.done(s) for s in range(5)):
        run.fused({}, [3, 1, 4, 0, 2])
    for slot, prompt in enumerate([PROMPTS[2], PROMPTS[4], "Continuous", PROMPTS[3], "#"]):
        assert run.generated[slot] == reference(lm, prompt), prompt


def test_a_fused_pass_gives_what_prefill_and_steps_give(lm_path: Path) -> None:
    """The same calls, one ``extend`` against prefill and step (a live slot given three
    tokens against three steps): logits to float error, and the caches written alike (the
    next steps agree)."""
    fused, apart = loaded(lm_path), loaded(lm_path)
    for model in (fused, apart):
        model.prefill([1, 3], [encode(PROMPTS[2]), encode(PROMPTS[0])])
    prompts = [encode(PROMPTS[4]), encode("a")]
    got = fused.extend(
        [3, 0, 1, 2],
        [np.array([7]), prompts[0], np.array([9, 10, 11]), prompts[1]],
        [False, True, False, True],
    )
    started = apart.prefill([0, 2], prompts)
    three = [apart.step([1], np.array([t])) for t in (9, 10, 11)][-1]
    want = np.stack([apart.step([3], np.array([7]))[0], started[0], three[0], started[1]])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert [fused.length(s) for s in range(4)] == [apart.length(s) for s in range(4)]
    assert [fused.length(s) for s in range(4)] == [14, 35, 1, 2]
    for tokens in ([5, 6, 7, 8], [1, 2, 3, 4]):
        ids = np.array(tokens)
        np.testing.assert_allclose(
            fused.step([0, 1, 2, 3], ids), apart.step([0, 1, 2, 3], ids), rtol=1e-5, atol=1e-5
        )


def test_the_contract_default_extend_gives_what_the_fused_pass_gives(lm_path: Path) -> None:
    fused, default = loaded(lm_path), loaded(lm_path)
    calls = [
        ([0, 2], [encode(PROMPTS[1]), encode("x")], [True, True]),
        ([2, 1, 0], [np.array([3]), encode(PROMPTS[4]), np.array([4, 5])], [False, True, False]),
    ]
    for slots, tokens, starts in calls:
        got = fused.extend(slots, tokens, starts)
        want = StepwiseHandler.extend(default, slots, tokens, starts)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert [fused.length(s) for s in range(4)] == [default.length(s) for s in range(4)]


def test_a_prompt_of_max_length_minus_one_takes_one_step_and_no_more(lm: TinyLM) -> None:
    lm.prefill([1], [np.ones(MAX_LENGTH - 1, dtype=np.int64)])
    assert lm.step([1], np.array([2])).shape == (1, VOCAB_SIZE)
    assert lm.length(1) == MAX_LENGTH
    with pytest.raises(ValueError, match=r"slot 1 is full: its sequence has max_length = 48"):
        lm.step([1], np.array([2]))


BAD_CALLS = [
    ("prefill", [0], [np.ones(MAX_LENGTH, np.int64)], r"prompt 0 has 48 tokens: at most .* 47"),
    ("prefill", [0], [np.zeros(0, np.int64)], r"prompt 0 is empty"),
    ("prefill", [4], [np.ones(2, np.int64)], r"slot 4 is out of range 0 \.\. 3"),
    ("prefill", [-1], [np.ones(2, np.int64)], r"slot -1 is out of range"),
    ("prefill", [0, 0], [np.ones(2, np.int64)] * 2, r"a slot appears twice"),
    ("prefill", [0], [np.array([1, 257])], r"token id outside 0 \.\. 256"),
    ("prefill", [0], [np.array([[1, 2]])], r"1-D array of integer"),
    ("prefill", [0], [np.array([1.0])], r"1-D array of integer"),
    ("prefill", [0, 1], [np.ones(2, np.int64)], r"2 slots but 1 prompts"),
    ("step", [3], np.array([1]), r"slot 3 holds no sequence: prefill it first"),
    ("step", [7], np.array([1]), r"slot 7 is out of range"),
    ("step", [2], np.array([-1]), r"token id outside"),
    ("step", [2], np.array([1, 2]), r"1 slots but 2 tokens"),
    ("prefill", [2], [np.ones(2, np.int64)], r"slots \[2\] hold a sequence: release them"),
]


BAD_EXTENDS = [
    ([2], [np.array([1])], [True], r"slot 2 holds a sequence: release it before a start"),
    ([0], [np.array([1])], [False], r"slot 0 holds no sequence: start it first"),
    ([0, 2], [encode("ok"), np.zeros(0, np.int64)], [True, False], r"slot 2 holds 4 tokens"),
    ([2], [np.ones(MAX_LENGTH - 3, np.int64)], [False], r"max_length - 4 = 44"),
    ([0], [np.ones(MAX_LENGTH, np.int64)], [True], r"prompt 0 has 48 tokens"),
    ([0, 2], [encode("ok"), np.array([257])], [True, False], r"token id outside 0 \.\. 256"),
    ([2], [np.array([[1]])], [False], r"tokens 0 must be a 1-D array of integer"),
    ([0, 2], [encode("ok")], [True, False], r"2 slots, 1 token rows, 2 starts"),
    ([2, 2], [np.array([1])] * 2, [False] * 2, r"a slot appears twice"),
    ([4], [np.array([1])], [True], r"slot 4 is out of range"),
]


@pytest.mark.parametrize(("slots", "tokens", "starts", "message"), BAD_EXTENDS)
def test_bad_extends_raise_value_error_and_change_nothing(
    lm: TinyLM, slots: list[int], tokens: list[np.ndarray], starts: list[bool], message: str
) -> None:
    lm.prefill([2], [encode("live")])
    before = [t.clone() for t in lm.cache]
    with pytest.raises(ValueError, match=message):
        lm.extend(slots, tokens, starts)
    assert [lm.length(s) for s in range(4)] == [0, 0, 4, 0]
    assert all(torch.equal(a, b) for a, b in zip(before, lm.cache))
    assert lm.extend([], [], []).shape == (0, VOCAB_SIZE)


@pytest.mark.parametrize(("method", "slots", "arg", "message"), BAD_CALLS)
def test_bad_calls_raise_value_error_and_change_nothing(
    lm: TinyLM, method: str, slots: list[int], arg: object, message: str
) -> None:
    lm.prefill([2], [encode("live")])
    with pytest.raises(ValueError, match=message):
        getattr(lm, method)(slots, arg)
    assert [lm.length(s) for s in range(4)] == [0, 0, 4, 0]


def test_a_bad_prompt_among_good_ones_starts_none_of_them(lm: TinyLM) -> None:
    with pytest.raises(ValueError, match=r"prompt 1 is empty"):
        lm.prefill([0, 1], [encode("ok"), encode("")])
    assert lm.length(0) == 0
    with pytest.raises(ValueError, match=r"slot 0 holds no sequence"):
        lm.step([0], np.array([1]))


def test_release_reference_and_setup_refuse_what_they_cannot_do(lm_path: Path) -> None:
    lm = loaded(lm_path)
    with pytest.raises(ValueError, match=r"slot 9 is out of range"):
        lm.release(9)
    lm.release(0)  # a free slot: nothing to forget
    with pytest.raises(ValueError, match=r"the prompt is empty"):
        lm.reference_generate(np.zeros(0, np.int64), 4)
    with pytest.raises(ValueError, match=r"max_length 300 is more than .* 256 positions"):
        loaded(lm_path, max_length=300)
    with pytest.raises(RuntimeError, match=r"setup\(device\) has not run"):
        TinyLM(path=lm_path).prefill([0], [encode("x")])


def test_the_build_is_deterministic_and_loads_with_weights_only(tmp_path: Path) -> None:
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    first = build_tiny_lm(tmp_path / "a.pt", steps=3)
    build_tiny_lm(tmp_path / "b.pt", steps=3)
    build_tiny_lm(tmp_path / "c.pt", steps=3, seed=1)
    a, b, c = (torch.load(tmp_path / n, weights_only=True) for n in ("a.pt", "b.pt", "c.pt"))
    assert a["config"] == b["config"] and all(isinstance(v, int) for v in a["config"].values())
    assert a["state_dict"].keys() == b["state_dict"].keys()
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    assert not torch.equal(a["state_dict"]["tok.weight"], c["state_dict"]["tok.weight"])
    assert first.parameters == 132_928 and first.steps == 3
    # the build leaves the caller's threads, random state and deterministic mode as they were
    assert torch.get_num_threads() == threads and torch.equal(torch.get_rng_state(), rng)
    assert not torch.are_deterministic_algorithms_enabled()


def test_build_models_builds_tinylm_with_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the real build trains for half a minute: the wiring is what is tested here
    monkeypatch.setattr(tiny_lm, "build_tiny_lm", functools.partial(build_tiny_lm, steps=1))
    argv = ["build_models", "--out", str(tmp_path), "--only", "tinylm"]
    monkeypatch.setattr(sys, "argv", argv)
    build_models.main()
    lm = loaded(tmp_path / "tinylm.pt")
    assert lm.prefill([0], [encode("hi")]).shape == (1, VOCAB_SIZE)


@pytest.mark.parametrize("mode", ["continuous", "static", "sequential"])
def test_the_generator_on_the_model_gives_what_recomputation_gives(
    lm_path: Path, mode: str
) -> None:
    """The scheduler (worker/serving/continuous.py) and the cache together: seven requests
    on three slots, so slots are freed and filled again, every request's greedy tokens equal
    the model's recomputation without a cache, whatever the mode."""
    from inferfleet.worker.serving.continuous import Generator, run_all

    lm = loaded(lm_path, max_slots=3)
    prompts = PROMPTS + ["x", "Continuous"]
    requests = [(f"r{i}", encode(p), {"max_new_tokens": 5 + 3 * i}) for i, p in enumerate(prompts)]
    got = run_all(Generator(lm, mode), requests)
    for (rid, prompt, params), text in zip(requests, prompts):
        expected = lm.reference_generate(prompt, params["max_new_tokens"]).tolist()
        assert got[rid] == expected, text
