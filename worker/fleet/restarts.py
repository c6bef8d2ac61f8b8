"""When a dead worker is restarted: exponential backoff, and when its slot is a crash loop.

A pure rule on the slot's recent death times, so the supervisor only
applies it and the unit tests replay it without processes.
"""

from __future__ import annotations

from collections import deque

__all__ = ["restart_backoff"]


def restart_backoff(
    deaths: deque[float],
    now_s: float,
    *,
    window_s: float,
    max_deaths: int,
    first_s: float,
    most_s: float,
) -> float | None:
    """Record a death at ``now_s`` in ``deaths``; the wait before the restart, or None to stop.

    Deaths older than ``window_s`` are forgotten. ``max_deaths`` within the
    window is a crash loop: restarting again would only repeat it. Otherwise
    the wait doubles with each recent death from ``first_s``, at most ``most_s``.
    """
    deaths.append(now_s)
    while deaths and deaths[0] < now_s - window_s:
        deaths.popleft()
    if len(deaths) >= max_deaths:
        return None
    return float(min(first_s * 2 ** (len(deaths) - 1), most_s))
