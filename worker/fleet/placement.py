"""Where the supervisor's children run: the device list and each child's visible GPUs.

One process per GPU by default: ``auto`` expands to every GPU this process
sees, and a child placed on ``cuda:N`` is given that GPU alone through
``CUDA_VISIBLE_DEVICES`` (so inside the child it is ``cuda:0``).
"""

from __future__ import annotations

from collections.abc import Sequence

from inferfleet.worker.errors import ConfigError

__all__ = ["child_visible_devices", "resolve_devices"]


def resolve_devices(devices: str) -> list[str]:
    """``auto`` -> every visible GPU, else the CPU; or an explicit ``cpu`` / ``cuda:0,cuda:1``
    list."""
    if devices == "auto":
        import torch  # only to count GPUs; children do the real work

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [f"cuda:{i}" for i in range(count)] or ["cpu"]
    parts = [d.strip() for d in devices.split(",") if d.strip()]
    for part in parts:
        if part != "cpu" and not (part.startswith("cuda:") and part[5:].isdigit()):
            raise ConfigError(f"device {part!r} is not one of auto, cpu or cuda:N[,cuda:M...]")
    if not parts:
        raise ConfigError("devices is empty: use auto, cpu or cuda:N[,cuda:M...]")
    return parts


def child_visible_devices(devices: Sequence[str], parent_visible: str | None) -> dict[str, str]:
    """Each ``cuda:N`` device's ``CUDA_VISIBLE_DEVICES`` value for a child placed on it.

    ``cuda:N`` counts the GPUs *this* process sees, so the child gets the
    N-th entry of the parent's own ``CUDA_VISIBLE_DEVICES`` (a scheduler's
    ``2,3``, or MIG UUIDs), or plain ``N`` where the parent sees every GPU
    (the variable unset). Raises ConfigError for an index the parent cannot see.
    """
    entries = (
        None
        if parent_visible is None
        else [e.strip() for e in parent_visible.split(",") if e.strip()]
    )
    mapping = {}
    for device in devices:
        if not device.startswith("cuda:"):
            continue
        index = int(device.split(":", 1)[1])
        if entries is not None and index >= len(entries):
            raise ConfigError(
                f"device {device}: CUDA_VISIBLE_DEVICES={parent_visible!r} makes only "
                f"{len(entries)} GPUs visible to the supervisor (cuda:0 to cuda:{len(entries) - 1})"
            )
        mapping[device] = str(index) if entries is None else entries[index]
    return mapping
