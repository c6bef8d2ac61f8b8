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
- ``release(slot)``: forget a slot's sequence (the slot may be prefilled again).

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
    """Base class of a step-wise model. Override ``setup``, ``prefill``, ``step``, ``release``."""

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
