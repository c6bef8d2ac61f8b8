"""Continuous batching's rules, on a counting model that checks the slot contract: who joins,
which token, when a sequence ends, that the mode never changes what a request gets, and that an
iteration is one forward pass (``extend``) for a model that fuses it, two (a prefill, then a
step) through the contract's default for one that does not."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from inferfleet.worker.runtime.stepwise import StepwiseHandler
from inferfleet.worker.serving.continuous import (
    GenerationParams,
    Generator,
    admitted,
    chunk_due,
    finish_reason,
    run_all,
    sample,
)

VOCAB, EOS = 16, 15


class Counting(StepwiseHandler):
    """Next token = last token + 1 (mod 15), so 15 (the end token) never comes by itself; every
    call checks the slots as a real cache would: prefill a free slot, step a live one."""

    vocab_size, eos_token, max_length = VOCAB, EOS, 64

    def __init__(self, slots: int = 4) -> None:
        self.max_slots = slots
        self.lengths: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []

    def _logits(self, last: Sequence[int]) -> np.ndarray:
        out = np.zeros((len(last), VOCAB), np.float32)
        out[np.arange(len(last)), (np.asarray(last) + 1) % EOS] = 1.0
        return out

    def prefill(self, slots, prompts):
        assert not set(slots) & set(self.lengths), "prefill of a live slot"
        self.lengths.update({s: len(p) for s, p in zip(slots, prompts)})
        self.calls.append(("prefill", len(slots)))
        return self._logits([int(p[-1]) for p in prompts])

    def step(self, slots, tokens):
        assert set(slots) <= set(self.lengths), "step of a free slot"
        for s in slots:
            self.lengths[s] += 1
            assert self.lengths[s] <= self.max_length
        self.calls.append(("step", len(slots)))
        return self._logits(tokens.tolist())

    def release(self, slot):
        del self.lengths[slot]


class Fused(Counting):
    """:class:`Counting` with its own ``extend``: one call (one forward pass) an iteration,
    recorded with its started and continued rows; it checks the slot contract as prefill and
    step do."""

    def extend(self, slots, tokens, starts):
        assert len(slots) == len(tokens) == len(starts)
        assert len(set(slots)) == len(slots), "a slot twice in one pass"
        for slot, row, start in zip(slots, tokens, starts):
            assert (slot not in self.lengths) if start else (slot in self.lengths), (slot, start)
            self.lengths[slot] = self.lengths.get(slot, 0) + len(row)
            assert self.lengths[slot] <= self.max_length
        self.calls.append(("extend", sum(starts), len(slots) - sum(starts)))
        return self._logits([int(row[-1]) for row in tokens])


def mixed(n: int) -> list[tuple[str, np.ndarray, dict]]:
    """``n`` requests, prompts of 1 to 5 tokens, asking for 1 to 20 tokens."""
    rng = np.random.default_rng(7)
    return [
        (f"r{i}", rng.integers(0, 14, size=1 + i % 5), {"max_new_tokens": int(rng.integers(1, 21))})
        for i in range(n)
    ]


def test_who_joins_in_each_mode() -> None:
    assert [admitted("continuous", free, 5, live) for free, live in ((4, 0), (2, 2))] == [4, 2]
    assert [admitted("static", free, 5, live) for free, live in ((4, 0), (2, 2))] == [4, 0]
    assert [admitted("sequential", free, 5, live) for free, live in ((4, 0), (3, 1))] == [1, 0]
    assert admitted("continuous", 4, 0, 0) == 0


def test_sampling_is_greedy_at_zero_temperature_and_repeats_with_a_seed() -> None:
    logits = np.array([0.1, 2.0, 1.9, -1.0], np.float32)
    rng = np.random.default_rng(0)
    assert sample(logits, GenerationParams(), rng) == 1
    assert sample(logits, GenerationParams(temperature=5.0, top_k=1), rng) == 1
    hot = GenerationParams(temperature=100.0, seed=3)
    draws = [sample(logits, hot, np.random.default_rng(3)) for _ in range(3)]
    assert len(set(draws)) == 1  # the same seed, the same draw
    many = {sample(logits, hot, rng) for _ in range(200)}
    assert many == {0, 1, 2, 3}  # hot: every token comes up
    assert {
        sample(logits, GenerationParams(temperature=100.0, top_k=2), rng) for _ in range(200)
    } == {
        1,
        2,
    }


def test_a_sequence_ends_at_its_end_token_a_stop_token_or_its_length() -> None:
    model = Counting()
    params = GenerationParams(max_new_tokens=3, stop=(7,))
    assert finish_reason(EOS, 1, 5, params, model) == "stop"
    assert finish_reason(7, 1, 5, params, model) == "stop"
    assert finish_reason(4, 3, 5, params, model) == "length"
    assert finish_reason(4, 1, model.max_length, params, model) == "length"
    assert finish_reason(4, 2, 5, params, model) is None


@pytest.mark.parametrize("mode", ["static", "sequential"])
def test_the_mode_never_changes_what_a_request_gets(mode: str) -> None:
    requests = mixed(11)
    expected = run_all(Generator(Counting(), "continuous"), requests)
    assert run_all(Generator(Counting(), mode), requests) == expected
    first, *_ = requests
    start = int(first[1][-1])
    assert expected["r0"] == [(start + 1 + i) % EOS for i in range(len(expected["r0"]))]
    assert all(len(expected[rid]) == p["max_new_tokens"] for rid, _, p in requests)


def test_continuous_batching_fills_freed_slots_and_needs_fewer_forward_passes() -> None:
    requests = [("long", np.array([1]), {"max_new_tokens": 20})] + [
        (f"short{i}", np.array([2]), {"max_new_tokens": 2}) for i in range(6)
    ]
    passes = {}
    for mode in ("continuous", "static"):
        model = Counting(slots=2)
        generator = Generator(model, mode)
        order: list[str] = []
        for rid, prompt, params in requests:
            generator.submit(rid, prompt, GenerationParams.from_params(params))
        while not generator.idle:
            order += [t.rid for t in generator.iterate() if t.finished]
        passes[mode] = len(model.calls)
        if mode == "continuous":  # the shorts run beside the long one, in its freed slot
            assert order[-1] == "long" and len(order) == 7
        else:  # a batch ends with its longest: every short after the long one waits for it
            assert order.index("long") < order.index("short1")
    assert passes["continuous"] < passes["static"]


def test_cancel_frees_a_live_slot_and_drops_a_waiting_request() -> None:
    model = Counting(slots=1)
    generator = Generator(model, "continuous")
    generator.submit("a", np.array([1]), GenerationParams(max_new_tokens=50))
    generator.submit("b", np.array([1]), GenerationParams(max_new_tokens=50))
    generator.submit("c", np.array([3]), GenerationParams(max_new_tokens=2))
    generator.iterate()
    assert generator.cancel("b") and generator.cancel("a") and not generator.cancel("zz")
    assert model.lengths == {}
    tokens = generator.iterate() + generator.iterate()
    assert [(t.rid, t.token) for t in tokens] == [("c", 4), ("c", 5)]
    assert tokens[-1].finished == "length" and generator.idle


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"stop": ["x"]}, "stop"),
        ({"beam": 4}, "unknown generation params"),
    ],
)
def test_bad_generation_params_are_refused_by_name(params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GenerationParams.from_params(params)


def test_bad_prompts_and_modes_are_refused() -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        Generator(Counting(), "eager")
    generator = Generator(Counting())
    with pytest.raises(ValueError, match="a prompt holds 1 to 63 tokens"):
        generator.submit("e", np.array([], np.int64), GenerationParams())
    with pytest.raises(ValueError, match="a prompt holds"):
        generator.submit("l", np.zeros(64, np.int64), GenerationParams())


def test_an_iteration_is_one_pass_for_a_model_that_fuses_it() -> None:
    """Every iteration is one ``extend`` call, the admitted prompts beside the live sequences'
    tokens (the Orca/vLLM fused pass), with the same tokens as the two-pass default."""
    requests = mixed(11)
    model = Fused(slots=4)
    generator = Generator(model, "continuous")
    for rid, prompt, params in requests:
        generator.submit(rid, prompt, GenerationParams.from_params(params))
    got: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    iterations = 0
    while not generator.idle:
        for token in generator.iterate():
            got[token.rid].append(token.token)
        iterations += 1
    assert len(model.calls) == iterations
    assert all(name == "extend" for name, _, _ in model.calls)
    # admissions mid-run share their pass with live sequences: the point of fusing
    assert any(started and going for _, started, going in model.calls)
    assert sum(started for _, started, _ in model.calls) == len(requests)
    assert got == run_all(Generator(Counting(slots=4), "continuous"), requests)
    for mode in ("static", "sequential"):
        assert run_all(Generator(Fused(slots=4), mode), requests) == got


def test_the_default_extend_is_a_prefill_then_a_step() -> None:
    """A model without its own ``extend`` (Counting) serves through the contract's default:
    an iteration that admits while sequences are live is a prefill and then a step, two
    passes, and only the admitted prompts go to the prefill."""
    model = Counting(slots=2)
    generator = Generator(model, "continuous")
    generator.submit("a", np.array([1, 2]), GenerationParams(max_new_tokens=5))
    generator.iterate()
    generator.submit("b", np.array([3, 4, 5]), GenerationParams(max_new_tokens=5))
    tokens = generator.iterate()
    assert model.calls == [("prefill", 1), ("prefill", 1), ("step", 1)]
    assert [(t.rid, t.token) for t in tokens] == [("b", 6), ("a", 4)]
    assert model.lengths == {1: 3, 0: 3}


def test_the_default_extend_steps_a_live_slot_given_several_tokens_once_a_token() -> None:
    model = Counting(slots=2)
    model.extend([0], [np.array([4])], [True])
    logits = model.extend([1, 0], [np.array([7, 8]), np.array([5, 6, 9])], [True, False])
    assert logits.argmax(axis=1).tolist() == [9, 10]  # each row's last token + 1
    assert model.lengths == {0: 4, 1: 2}
    assert model.calls[1:] == [("prefill", 1), ("step", 1), ("step", 1), ("step", 1)]
    with pytest.raises(ValueError, match="1 slots, 2 token rows, 1 starts"):
        model.extend([0], [np.array([1]), np.array([2])], [False])
    with pytest.raises(ValueError, match="one token or more"):
        model.extend([0], [np.array([], np.int64)], [False])


class Failing(Fused):
    """Fails its second pass, once."""

    failed = False

    def extend(self, slots, tokens, starts):
        if len(self.calls) == 1 and not self.failed:
            self.failed = True
            raise RuntimeError("device lost")
        return super().extend(slots, tokens, starts)


def test_a_failed_pass_leaves_the_admitted_requests_waiting_and_their_slots_free() -> None:
    model = Failing(slots=3)
    generator = Generator(model, "continuous")
    generator.submit("a", np.array([1]), GenerationParams(max_new_tokens=9))
    generator.iterate()
    for rid in ("b", "c"):
        generator.submit(rid, np.array([2]), GenerationParams(max_new_tokens=9))
    with pytest.raises(RuntimeError, match="device lost"):
        generator.iterate()
    assert [rid for rid, _, _ in generator.waiting] == ["b", "c"]
    assert len(generator.live) == 1
    assert generator.cancel("b") and generator.cancel("a") and model.lengths == {}
    generator.submit("d", np.array([5]), GenerationParams(max_new_tokens=9))
    generator.submit("e", np.array([7]), GenerationParams(max_new_tokens=9))
    tokens = generator.iterate()  # all three slots are free again
    assert [(t.rid, t.token) for t in tokens] == [("c", 3), ("d", 6), ("e", 8)]


class StepFails(Counting):
    """Fails its first step."""

    failed = False

    def step(self, slots, tokens):
        if not self.failed:
            self.failed = True
            raise RuntimeError("device lost")
        return super().step(slots, tokens)


def test_a_default_extend_whose_step_fails_starts_no_sequence() -> None:
    model = StepFails(slots=2)
    model.extend([0], [np.array([1])], [True])
    rows = [np.array([2, 3]), np.array([4])]
    with pytest.raises(RuntimeError, match="device lost"):
        model.extend([1, 0], rows, [True, False])
    assert model.lengths == {0: 1}  # slot 1's prefill undone: it may be started again
    assert model.extend([1, 0], rows, [True, False]).argmax(axis=1).tolist() == [4, 5]


def test_a_padded_batch_computes_its_finished_rows_until_its_longest_ends():
    """``padded`` is static batching as a batched generate call runs it: the same tokens, the
    same passes as ``static``, but every pass computes every row of the batch, finished or
    not, and its slots free together."""
    rows: dict[str, list[int]] = {}
    results = {}
    for mode in ("static", "padded"):
        model = Fused(4)
        requests = [
            (f"r{i}", np.array([1 + i]), {"max_new_tokens": n})
            for i, n in enumerate((2, 7, 3, 5, 4))
        ]
        results[mode] = run_all(Generator(model, mode), requests)
        rows[mode] = [started + going for _, started, going in model.calls]
    assert results["padded"] == results["static"]
    assert len(rows["padded"]) == len(rows["static"])
    assert rows["static"][:7] == [4, 4, 3, 2, 2, 1, 1]  # finished rows leave
    assert rows["padded"][:7] == [4, 4, 4, 4, 4, 4, 4]  # they are computed on
    assert rows["padded"][7:] == rows["static"][7:] == [1, 1, 1, 1]  # the 5th request alone


def test_cancelling_the_last_live_row_of_a_padded_batch_frees_every_slot():
    generator = Generator(Fused(2), "padded")
    for rid, n in (("long", 50), ("short", 1)):
        generator.submit(rid, np.array([1]), GenerationParams(max_new_tokens=n))
    generator.iterate()
    assert set(generator.padding) and set(generator.live)
    assert generator.cancel("long")
    assert generator.idle and not generator.padding
    generator.submit("next", np.array([1]), GenerationParams(max_new_tokens=2))
    generator.submit("after", np.array([1]), GenerationParams(max_new_tokens=2))
    assert len(generator.iterate()) == 2  # both slots were free again


def test_a_chunk_goes_out_with_the_first_token_then_once_its_oldest_token_waited_chunk_ms():
    assert not chunk_due(0, False, 0.0, 5.0, 0.02)  # nothing to send
    assert chunk_due(1, False, 1.0, 1.0, 0.02)  # the first token: at once
    assert not chunk_due(3, True, 1.0, 1.019, 0.02)
    assert chunk_due(3, True, 1.0, 1.02, 0.02)
    assert chunk_due(1, True, 1.0, 1.0, 0.0)  # 0: a chunk a token
