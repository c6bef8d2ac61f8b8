"""Arrival traces for the scaling replayer and the autoscaling benchmark: rates, then arrivals.

A trace is a rate over time (requests per second at ``t`` seconds);
:func:`arrivals` turns one into request times, a Poisson process of that
rate drawn from a seed (the same seed, the same times). Four are named:

* ``diurnal``: an ad-traffic day compressed into ``seconds`` (600: one hour
  in 25 s): a night trough, a late-morning peak and a higher evening one;
* ``flash``: a steady base, then ten times it within 30 s (a flash crowd),
  held, then back;
* ``ramp``: a slow climb from a low rate to a high one, then held;
* a file a user supplies: one arrival time a line in seconds (a Unix time
  or an offset; blank lines and ``#`` comments skipped), read by
  :func:`read_trace_file`.

``peak_rps`` scales each named trace so its highest rate is that.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

__all__ = ["TRACES", "Rate", "rate_of", "arrivals", "read_trace_file", "rates_per_second"]

#: ``rate(t)`` in requests per second at ``t`` seconds from the trace's start.
Rate = Callable[[float], float]


def _diurnal(seconds: float, peak_rps: float) -> Rate:
    def rate(t: float) -> float:
        hour = 24.0 * t / seconds
        morning = 0.62 * math.exp(-(((hour - 11.0) / 2.4) ** 2))
        evening = 0.9 * math.exp(-(((hour - 20.5) / 1.9) ** 2))
        return peak_rps * (0.1 + morning + evening)

    return rate


def _flash(seconds: float, peak_rps: float) -> Rate:
    base, start, rise = peak_rps / 10, seconds * 0.25, 30.0
    hold = seconds * 0.35

    def rate(t: float) -> float:
        if t < start or t > start + rise + hold + rise:
            return base
        if t < start + rise:
            return base + (peak_rps - base) * (t - start) / rise
        if t <= start + rise + hold:
            return peak_rps
        return peak_rps - (peak_rps - base) * (t - start - rise - hold) / rise

    return rate


def _ramp(seconds: float, peak_rps: float) -> Rate:
    low, climb = peak_rps / 12, seconds * 0.8

    def rate(t: float) -> float:
        return low + (peak_rps - low) * min(t / climb, 1.0)

    return rate


#: The named traces: ``TRACES[name](seconds, peak_rps)`` is its rate.
TRACES: dict[str, Callable[[float, float], Rate]] = {
    "diurnal": _diurnal,
    "flash": _flash,
    "ramp": _ramp,
}


def rate_of(name: str, seconds: float, peak_rps: float) -> Rate:
    """The named trace's rate (ValueError naming the known ones otherwise)."""
    if name not in TRACES:
        raise ValueError(f"unknown trace {name!r}: one of {', '.join(TRACES)} or a file")
    if not seconds > 0 or not peak_rps > 0:
        raise ValueError(f"seconds and peak_rps must be positive, got {seconds}, {peak_rps}")
    return TRACES[name](seconds, peak_rps)


def arrivals(rate: Rate, seconds: float, seed: int = 0, step_s: float = 0.1) -> np.ndarray:
    """Request times in ``[0, seconds)``: a Poisson process of ``rate``, sorted.

    The rate is taken as constant over each ``step_s``: a Poisson count per
    step, spread uniformly inside it.
    """
    rng = np.random.default_rng(seed)
    starts = np.arange(0.0, seconds, step_s)
    means = np.array([max(rate(float(t) + step_s / 2), 0.0) * step_s for t in starts])
    counts = rng.poisson(means)
    times = np.repeat(starts, counts) + rng.uniform(0.0, step_s, int(counts.sum()))
    return np.sort(times[times < seconds])


def read_trace_file(path: str | Path) -> np.ndarray:
    """Arrival times from a file of one time a line, shifted to start at 0 and sorted.

    ValueError names the line of anything that is not a finite number, and an empty trace.
    """
    times = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{path}:{number}: {text!r} is not a time in seconds") from None
        if not math.isfinite(value):
            raise ValueError(f"{path}:{number}: {text!r} is not a finite time")
        times.append(value)
    if not times:
        raise ValueError(f"{path}: no arrival times in it")
    array = np.sort(np.array(times, dtype=float))
    return array - array[0]


def rates_per_second(times: np.ndarray, seconds: float) -> np.ndarray:
    """How many requests arrived in each whole second (for plots and tables)."""
    bins = np.arange(0.0, math.ceil(seconds) + 1.0)
    counts, _ = np.histogram(times, bins=bins)
    return counts.astype(float)
