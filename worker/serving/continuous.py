"""Continuous batching of step-wise models: who joins, which token, when a sequence ends.

A generative request runs for many forward passes. Batched statically, a batch starts
together and ends with its longest member: the slots of the short ones idle, and a request
that arrives meanwhile waits for the whole batch. Batched continuously (Orca's
iteration-level scheduling, as vLLM and TGI serve), every iteration admits waiting requests
into free slots (their prefill gives their first token) and steps every live sequence once;
a sequence that ends frees its slot at once. An iteration is one forward pass: the admitted
prompts and the live sequences' new tokens go to the model together
(:meth:`~inferfleet.worker.runtime.stepwise.StepwiseHandler.extend`, Orca's selective
batching), not a prefill pass per admission before the step pass.

The rules are plain functions (:func:`admitted`, :func:`sample`, :func:`finish_reason`) and
:class:`Generator` drives a :class:`~inferfleet.worker.runtime.stepwise.StepwiseHandler` with
them, in one of four modes: ``continuous``, ``static`` (admit only into an empty batch; a
finished sequence leaves it), ``padded`` (the same, with a finished sequence's row computed
on until the batch's longest ends, as a batched ``generate`` call does: its tokens
discarded) and ``sequential`` (one request at a time), the last three derived from the same
rule for the
measurements of docs/benchmarks.md.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inferfleet.worker.runtime.stepwise import StepwiseHandler

__all__ = [
    "chunk_due",
    "MODES",
    "GenerationParams",
    "Generator",
    "Token",
    "admitted",
    "finish_reason",
    "sample",
]

#: How requests join a running batch.
MODES = ("continuous", "static", "padded", "sequential")
#: The most tokens one request may ask for.
MAX_NEW_TOKENS = 4096


@dataclass(frozen=True)
class GenerationParams:
    """A request's generation settings (its ``params``): ``max_new_tokens``, ``temperature``
    (0: greedy), ``top_k`` (0: the whole vocabulary), ``seed`` (sampling repeats with it) and
    ``stop`` (token ids that end the sequence, like the model's end token)."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[int, ...] = ()

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> GenerationParams:
        """Read and check a request's params; ValueError names the bad one."""
        params = dict(params or {})
        unknown = set(params) - {"max_new_tokens", "temperature", "top_k", "seed", "stop"}
        if unknown:
            raise ValueError(f"unknown generation params: {sorted(unknown)}")
        out = cls(
            max_new_tokens=params.get("max_new_tokens", cls.max_new_tokens),
            temperature=params.get("temperature", cls.temperature),
            top_k=params.get("top_k", cls.top_k),
            seed=params.get("seed"),
            stop=tuple(params.get("stop", ())),
        )
        out.check()
        return out

    def check(self) -> None:
        """ValueError unless every setting is in range."""
        if not _is_int(self.max_new_tokens) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(f"max_new_tokens must be 1 to {MAX_NEW_TOKENS}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError("temperature must be a number")
        if not 0 <= self.temperature <= 100:
            raise ValueError("temperature must be 0 (greedy) to 100")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError("top_k must be an int, 0 (all) or more")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError("seed must be an int")
        if not all(_is_int(t) and t >= 0 for t in self.stop):
            raise ValueError("stop must be a list of token ids")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def admitted(mode: str, free: int, waiting: int, live: int) -> int:
    """How many waiting requests join now: as many as there are free slots (``continuous``),
    only into an empty batch (``static``, ``padded``), or one into an empty batch
    (``sequential``). ``live`` counts a padded batch's finished rows too."""
    if mode == "continuous":
        return min(free, waiting)
    if live:
        return 0
    return min(free, waiting, 1 if mode == "sequential" else waiting)


def sample(logits: np.ndarray, params: GenerationParams, rng: np.random.Generator) -> int:
    """The next token from one row of logits: the largest (temperature 0), else drawn from the
    softmax of the ``top_k`` largest at ``temperature``."""
    if params.temperature == 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < scaled.size:
        cut = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled >= cut, scaled, -np.inf)
    weights = np.exp(scaled - scaled.max())
    return int(rng.choice(scaled.size, p=weights / weights.sum()))


def finish_reason(
    token: int, generated: int, length: int, params: GenerationParams, model: StepwiseHandler
) -> str | None:
    """Why a sequence ends after ``token`` (its ``generated``-th, the slot now ``length`` long):
    ``stop`` (the end token or a stop token), ``length`` (max_new_tokens, or the slot full),
    or None to go on."""
    if token == model.eos_token or token in params.stop:
        return "stop"
    if generated >= params.max_new_tokens or length >= model.max_length:
        return "length"
    return None


def chunk_due(unsent: int, first_sent: bool, oldest_s: float, now_s: float, chunk_s: float) -> bool:
    """Whether a streamed sequence's ``unsent`` tokens go out as a chunk now: its first token at
    once (the time to first token is not delayed), then whatever waited ``chunk_s`` or more
    since the oldest of them was made (0: every token); the last one always (the caller's)."""
    if not unsent:
        return False
    return not first_sent or now_s - oldest_s >= chunk_s


@dataclass(frozen=True)
class Token:
    """One generated token of request ``rid``: its ``index`` (0 first) and, on its last,
    why the sequence ended."""

    rid: str
    token: int
    index: int
    finished: str | None = None


@dataclass
class _Live:
    rid: str
    slot: int
    params: GenerationParams
    rng: np.random.Generator
    length: int
    generated: int = 0
    last: int = 0


@dataclass
class Generator:
    """Drives ``model`` in ``mode``: :meth:`submit` requests, :meth:`iterate` until idle."""

    model: StepwiseHandler
    mode: str = "continuous"
    waiting: deque = field(default_factory=deque)
    live: dict[int, _Live] = field(default_factory=dict)
    #: ``padded`` mode: finished sequences whose rows the batch still computes, by slot
    padding: dict[int, _Live] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        self._free = list(range(self.model.max_slots - 1, -1, -1))

    @property
    def idle(self) -> bool:
        """Nothing waits and nothing runs."""
        return not self.waiting and not self.live

    def submit(self, rid: str, prompt: np.ndarray, params: GenerationParams) -> None:
        """Queue a request: its prompt (int64 token ids, 1 or more, shorter than the slots)."""
        prompt = np.asarray(prompt, dtype=np.int64).reshape(-1)
        if not 1 <= prompt.size < self.model.max_length:
            raise ValueError(f"a prompt holds 1 to {self.model.max_length - 1} tokens")
        params.check()
        self.waiting.append((rid, prompt, params))

    def iterate(self) -> list[Token]:
        """One iteration, one forward pass (:meth:`StepwiseHandler.extend`): the requests the
        mode admits now start from their prompts (each gets its first token) and every
        sequence that was live takes one step; the tokens made, the admitted ones' first.

        If the model raises, the admitted requests go back to the head of the queue and their
        slots back to the free ones, so :meth:`cancel` still finds them."""
        stepping = list(self.live.values())
        padding = [s for s in self.padding.values() if s.length + 1 < self.model.max_length]
        busy = len(self.live) + len(self.padding)
        count = admitted(self.mode, len(self._free), len(self.waiting), busy)
        joining = [self.waiting.popleft() for _ in range(count)]
        seqs = [
            _Live(rid, self._free.pop(), params, np.random.default_rng(params.seed), prompt.size)
            for rid, prompt, params in joining
        ]
        if not seqs and not stepping:
            return []
        rows = stepping + padding
        try:
            logits = self.model.extend(
                [s.slot for s in seqs + rows],
                [p for _, p, _ in joining] + [np.array([s.last], np.int64) for s in rows],
                [True] * len(seqs) + [False] * len(rows),
            )
        except BaseException:
            self._free.extend(s.slot for s in reversed(seqs))
            self.waiting.extendleft(reversed(joining))
            raise
        made = []
        for seq, row in zip(seqs, logits):
            self.live[seq.slot] = seq
            made.append(self._emit(seq, row))
        for seq, row in zip(stepping, logits[len(seqs) :]):
            seq.length += 1
            made.append(self._emit(seq, row))
        for seq in padding:
            seq.length += 1  # computed, its logits dropped
        self._end_padded_batch()
        return made

    def _end_padded_batch(self) -> None:
        """A padded batch is over when its last live row ends: its other rows' slots free."""
        if not self.live:
            for slot in list(self.padding):
                self._release(slot, self.padding)

    def _release(self, slot: int, holder: dict[int, _Live]) -> None:
        self.model.release(slot)
        del holder[slot]
        self._free.append(slot)

    def _emit(self, seq: _Live, logits: np.ndarray) -> Token:
        token = sample(logits, seq.params, seq.rng)
        seq.generated += 1
        seq.last = token
        why = finish_reason(token, seq.generated, seq.length + 1, seq.params, self.model)
        if why is not None and self.mode == "padded" and self.live.keys() - {seq.slot}:
            self.padding[seq.slot] = self.live.pop(seq.slot)  # its row goes on with the batch
        elif why is not None:
            self._release(seq.slot, self.live)
        return Token(seq.rid, token, seq.generated - 1, why)

    def cancel(self, rid: str) -> bool:
        """End request ``rid`` now (waiting or live); whether it was there."""
        for i, (waiting_rid, _, _) in enumerate(self.waiting):
            if waiting_rid == rid:
                del self.waiting[i]
                return True
        for slot, seq in list(self.live.items()):
            if seq.rid == rid:
                self._release(slot, self.live)
                self._end_padded_batch()
                return True
        return False


def run_all(generator: Generator, requests: Sequence[tuple[str, np.ndarray, Any]]) -> dict:
    """Submit ``requests`` (rid, prompt, params) at once and iterate until idle; each rid's
    tokens in order (a helper for tests and the benchmark)."""
    out: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    for rid, prompt, params in requests:
        generator.submit(rid, prompt, GenerationParams.from_params(params))
    while not generator.idle:
        for token in generator.iterate():
            out[token.rid].append(token.token)
    return out
