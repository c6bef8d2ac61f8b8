"""Handlers used by the tests (loaded by workers as ``tests.handlers:NAME``)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import torch

from inferfleet.worker.handler import Handler
from tests.fixtures.tiny_lm import TinyLM

POISON = -999.0


class Scale(Handler):
    """y = x * params.get("factor", 2); raises on any row whose first value is POISON."""

    version = "scale-1"

    def example_inputs(self) -> np.ndarray:
        return np.ones((2, 4), dtype=np.float32)

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        if bool((x[:, 0] == POISON).any()):
            raise ValueError("poison row in batch")
        return x * float(params.get("factor", 2.0))


class WrongRows(Handler):
    """Returns one row too few: every request must get model_error."""

    def example_inputs(self) -> None:
        return None

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        return x[1:]


class CrashOnPoison(Scale):
    """Kills its own process on a poison row (a segfault-like crash)."""

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        if bool((x[:, 0] == POISON).any()):
            os._exit(17)
        return x * 2.0


class Slow(Scale):
    """Scale, but each batch takes SLOW_BATCH_S (a model too slow for one worker)."""

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        import time

        time.sleep(float(os.environ.get("SLOW_BATCH_S", "0.02")))
        return x * 2.0


class OutOfMemoryOverRows(Scale):
    """Raises torch.OutOfMemoryError on batches over OOM_ROWS rows (a GPU that is too small)."""

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        if x.shape[0] > int(os.environ.get("OOM_ROWS", "8")):
            raise torch.OutOfMemoryError(f"CUDA out of memory on {x.shape[0]} rows (simulated)")
        return x * 2.0


#: Weak references to the activations OutOfMemoryHoldingActivations made (the test reads them).
ACTIVATIONS: list = []


class OutOfMemoryHoldingActivations(Scale):
    """OutOfMemoryOverRows, but each failing pass first makes an activation that only its frame
    holds (a weak reference goes to ACTIVATIONS): freed once nothing keeps the frame alive."""

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        import weakref

        activation = x * 3.0
        ACTIVATIONS.append(weakref.ref(activation))
        if x.shape[0] > int(os.environ.get("OOM_ROWS", "8")):
            raise torch.OutOfMemoryError(f"CUDA out of memory on {x.shape[0]} rows (simulated)")
        return x * 2.0


STALL = -7.0


class Stall(Scale):
    """Scale, but a batch holding a row that starts with STALL takes STALL_S seconds (30 by
    default)."""

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        if bool((x[:, 0] == STALL).any()):
            import time

            time.sleep(float(os.environ.get("STALL_S", "30")))
        return x * 2.0


GATE = -5.0


class Gate(Scale):
    """Scale, but a batch holding a row that starts with GATE sets ``Gate.entered``, then waits
    for ``Gate.release`` (the test sets it, in-process): a batch held in flight at will."""

    entered = threading.Event()
    release = threading.Event()

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        if bool((x[:, 0] == GATE).any()):
            Gate.entered.set()
            Gate.release.wait(60)
        return x * 2.0


class Triple(Scale):
    """y = x * 3, version triple-1: the 'new model' of the hot swap tests."""

    version = "triple-1"

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        return x * 3.0


class Wide(Triple):
    """Triple on float32[N,8]: another signature than Scale's float32[N,4] (swap --check refuses
    it)."""

    version = "wide-1"

    def example_inputs(self) -> np.ndarray:
        return np.ones((2, 8), dtype=np.float32)


class Halves(Scale):
    """Takes Scale's inputs but returns half the columns: outputs of another form (swap --check
    refuses it)."""

    version = "halves-1"

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        return x[:, :2] * 2.0


class CallCounter(Handler):
    """Each output row is (number of this predict call, rows in this call): what was computed."""

    version = "counter-1"

    def __init__(self) -> None:
        self.calls = 0

    def example_inputs(self) -> np.ndarray:
        return np.ones((1, 4), dtype=np.float32)

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        self.calls += 1
        out = torch.zeros((x.shape[0], 2))
        out[:, 0] = self.calls
        out[:, 1] = x.shape[0]
        return out


class NanOnNegative(Scale):
    """x * 2, but NaN for rows whose first value is negative (a numerically broken model)."""

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        y = x * 2.0
        y[x[:, 0] < 0] = float("nan")
        return y


class Probabilities(Scale):
    """softmax over each row: a classifier's scores, for the confidence threshold."""

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        return torch.softmax(x, dim=1)


class Noisy(Scale):
    """x plus fresh noise on every call: identical inputs give different outputs."""

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        return x + torch.rand_like(x)


class Fragile(Scale):
    """x * 2 like Scale (version fragile-1), but raises on rows whose first value is 1000 or more:
    a candidate that starts failing on traffic the live model serves."""

    version = "fragile-1"

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        if bool((x[:, 0] >= 1000).any()):
            raise ValueError("fragile: value out of the range it was trained on")
        return x * 2.0


#: What torch raises on a GPU after an out-of-range embedding id (the device-side assert).
DEVICE_ASSERT = (
    "CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously "
    "reported at some other API call, so the stacktrace below might be incorrect."
)


class BreaksDevice(Scale):
    """x * 2 on a simulated GPU: a row starting with POISON (an out-of-range embedding id) triggers
    a device-side assert, and from then on every call in this process fails the same way, as every
    CUDA call does once the context is lost. ``calls`` counts predict calls in this process."""

    broken = False
    calls = 0

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        BreaksDevice.calls += 1
        if BreaksDevice.broken or bool((x[:, 0] == POISON).any()):
            BreaksDevice.broken = True
            raise RuntimeError(DEVICE_ASSERT)
        return x * 2.0


#: First value of every row a Recorder computed, in order (in-process consumers: the tests read it).
COMPUTED: list[float] = []


class Recorder(Scale):
    """x * 2, recording each computed row's first value in COMPUTED; each batch takes
    RECORDER_BATCH_S."""

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        import time

        COMPUTED.extend(float(v) for v in x[:, 0])
        time.sleep(float(os.environ.get("RECORDER_BATCH_S", "0")))
        return x * 2.0


#: Called once (then cleared) by CancelOnPoison on the first batch holding a POISON row.
ON_POISON: list = []


class CancelOnPoison(Recorder):
    """Recorder that, on a batch holding a POISON row, first runs (and clears) the ON_POISON hooks,
    then raises."""

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        if bool((x[:, 0] == POISON).any()):
            while ON_POISON:
                ON_POISON.pop()()
            raise ValueError("poison row in batch")
        return super().predict(x, params)


class FrozenHeap(Scale):
    """Answers every row with how many objects the worker froze out of the GC's sight at start."""

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        import gc

        return torch.full_like(x, float(gc.get_freeze_count()))


class SlowTinyLM(TinyLM):
    """The example language model with 4 slots, each pass held 20 ms: a generation long enough
    for a test to cancel, expire or kill it midway (tests/integration/test_generation.py)."""

    def __init__(self) -> None:
        super().__init__(max_slots=4)

    def extend(self, slots, tokens, starts):  # type: ignore[no-untyped-def]
        time.sleep(0.02)
        return super().extend(slots, tokens, starts)


class EndlessTinyLM(SlowTinyLM):
    """:class:`SlowTinyLM` that never makes its end token: a sequence runs to its
    max_new_tokens, so a test's cancel or deadline always meets it live."""

    def extend(self, slots, tokens, starts):  # type: ignore[no-untyped-def]
        logits = np.array(super().extend(slots, tokens, starts), copy=True)
        logits[:, self.eos_token] = -np.inf
        return logits


class FlakyTinyLM(EndlessTinyLM):
    """:class:`EndlessTinyLM` whose every pass raises while the file named by ``$FLAKY_FLAG``
    exists: the model failing mid-generation (tests/integration/test_generation.py)."""

    def extend(self, slots, tokens, starts):  # type: ignore[no-untyped-def]
        flag = os.environ.get("FLAKY_FLAG")
        if flag and os.path.exists(flag):
            raise RuntimeError("the device fell over")
        return super().extend(slots, tokens, starts)
