"""A candidate is refused when the device has no room for a second copy beside the live one."""

from __future__ import annotations

import torch

from inferfleet.worker.runtime.memory import room_for_another_copy

MIB = 1024 * 1024


def test_a_cpu_always_has_room() -> None:
    assert room_for_another_copy("cpu") is None


def test_a_gpu_needs_the_live_copys_size_and_a_margin_free(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1000 * MIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1100 * MIB, 80_000 * MIB))
    problem = room_for_another_copy("cuda:0")
    assert problem is not None and "1100 MiB free" in problem and "1200 MiB" in problem
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1300 * MIB, 80_000 * MIB))
    assert room_for_another_copy("cuda:0") is None
