"""The contract of a step-wise (generative) model: prefill, then one token a step, per slot.

A generative request runs for many steps. Served in fixed batches, a batch waits for its
longest member and nothing joins it; served continuously, every step is one forward pass over
the sequences live now, finished ones leave and waiting ones join
(:mod:`inferfleet.worker.serving.continuous`). A model serves that way when it keeps one
sequence's state (its key-value cache) in each of ``max_slots`` slots on its device:

- ``prefill(slots, prompts)``: start a sequence in each slot from its prompt (int64 token ids)
  and return the logits of the token that follows each (float32[len(slots), vocab_size]);
- ``step(slots, tokens)``: append one token to each slot's sequence and return the logits of
  the next (float32[len(slots), vocab_size]); any subset of live slots, in any order;
- ``release(slot)``: forget a slot's sequence (the slot may be prefilled again);
- ``extend(slots, tokens, starts)``: one forward pass that appends ``tokens[i]`` (int64, one
  token or more) to slot ``slots[i]``'s sequence, a whole prompt for a slot being started
  (``starts[i]`` true: the slot must be free) and usually one token for a live one, and returns
  the next token's logits of each (float32[len(slots), vocab_size]). It is how the scheduler
  runs an iteration: the prompts admitted now and the live sequences' new tokens in ONE pass
  (Orca's selective batching, vLLM's chunked prefill), which saves a pass's fixed cost at
  every admission. ``starts`` is explicit so that a model needs no guess of which slots are
  new (a one-token prompt looks like a step). Optional: the default runs ``prefill`` for the
  started slots, then ``step`` for the others (a live slot given k tokens takes k steps), the
  same tokens in two passes or more; a model overrides it to do it in one.

Slots are numbered 0 .. ``max_slots - 1``; a sequence's prompt and generated tokens together
never exceed ``max_length`` (the scheduler ends it first). Sampling the next token from the
logits is the worker's (:func:`inferfleet.worker.serving.continuous.sample`), per request.
This module imports nothing of the worker: it is a contract, like
:mod:`inferfleet.worker.handler`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["StepwiseHandler"]


class StepwiseHandler:
    """Base class of a step-wise model. Override ``setup``, ``prefill``, ``step``, ``release``
    (and ``extend``, to run an iteration in one pass)."""

    #: Reported in every reply; None lets the worker use --model-version or "1".
    version: str | None = None
    device: torch.device = torch.device("cpu")
    #: Token ids are 0 .. vocab_size - 1.
    vocab_size: int = 0
    #: The token that ends a sequence (None: only max_new_tokens and stop tokens end one).
    eos_token: int | None = None
    #: Sequences live at once (the key-value cache's slots).
    max_slots: int = 1
    #: Tokens a slot holds: prompt and generated together.
    max_length: int = 0

    def setup(self, device: torch.device) -> None:
        """Load weights, place them on ``device`` and allocate the slots. Called once."""
        self.device = device

    def encode_prompt(self, inputs: Any) -> np.ndarray:
        """A request's ``inputs`` as the prompt's token ids (int64, one dimension).

        The default takes an integer tensor of one row (``[n]`` or ``[1, n]``); a model with a
        tokenizer overrides this to take text too. ValueError says what is wrong."""
        one_row = isinstance(inputs, np.ndarray) and (
            inputs.ndim == 1 or (inputs.ndim == 2 and inputs.shape[0] == 1)
        )
        if one_row and inputs.dtype.kind in "iu":
            tokens = inputs.reshape(-1).astype(np.int64)
            if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
                raise ValueError(f"token ids must be 0 to {self.vocab_size - 1}")
            return tokens
        raise ValueError("the prompt must be one row of integer token ids ([n] or [1, n])")

    def prefill(self, slots: Sequence[int], prompts: Sequence[np.ndarray]) -> np.ndarray:
        """Start each slot's sequence from its prompt; the next token's logits of each."""
        raise NotImplementedError

    def step(self, slots: Sequence[int], tokens: np.ndarray) -> np.ndarray:
        """Append ``tokens[i]`` to slot ``slots[i]``'s sequence; the next token's logits of each."""
        raise NotImplementedError

    def release(self, slot: int) -> None:
        """Forget the sequence in ``slot``."""

    def extend(
        self, slots: Sequence[int], tokens: Sequence[np.ndarray], starts: Sequence[bool]
    ) -> np.ndarray:
        """Append ``tokens[i]`` to slot ``slots[i]``'s sequence, starting it if ``starts[i]``;
        the next token's logits of each, float32[len(slots), vocab_size].

        This default is built from :meth:`prefill` (the started slots, one pass) and
        :meth:`step` (the others, one pass a token), so every handler has it; a model that can
        run them all in one forward pass overrides it. If a step raises, the slots this call
        started are released: a call that fails starts no sequence."""
        if not len(slots) == len(tokens) == len(starts):
            raise ValueError(f"{len(slots)} slots, {len(tokens)} token rows, {len(starts)} starts")
        rows = [np.asarray(t).reshape(-1) for t in tokens]
        if any(row.size == 0 for row in rows):
            raise ValueError("every slot is extended by one token or more")
        out = np.zeros((len(slots), self.vocab_size), dtype=np.float32)
        started = [i for i, start in enumerate(starts) if start]
        if started:
            out[started] = self.prefill([slots[i] for i in started], [tokens[i] for i in started])
        going = [i for i, start in enumerate(starts) if not start]
        try:
            for k in range(max((rows[i].size for i in going), default=0)):
                now = [i for i in going if rows[i].size > k]
                ids = np.array([rows[i][k] for i in now], dtype=np.int64)
                out[now] = self.step([slots[i] for i in now], ids)
        except BaseException:
            for i in started:
                self.release(slots[i])
            raise
        return out
