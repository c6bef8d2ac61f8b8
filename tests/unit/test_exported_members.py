"""The public API is pinned: a change to __all__ must be deliberate."""

from __future__ import annotations

import inspect

import inferfleet
from inferfleet import producer, worker


def test_producer_exported_members() -> None:
    assert producer.__all__ == [
        "AsyncProducer",
        "BadRequest",
        "CONTRACT_VERSION",
        "Cancelled",
        "ConnectionError",
        "DEFAULT_PREFIX",
        "DEFAULT_REDIS_URL",
        "DeadLetter",
        "Durability",
        "Expired",
        "InferfleetError",
        "ModelError",
        "NotReplicated",
        "Overloaded",
        "Producer",
        "ProtocolError",
        "QueueFull",
        "QueueKeys",
        "RateLimited",
        "Reply",
        "ReplyError",
        "ReplyTimeout",
        "Throttled",
        "TooLarge",
    ]


def test_the_package_exports_the_sdk() -> None:
    assert inferfleet.__all__ == producer.__all__
    assert all(getattr(inferfleet, name) is getattr(producer, name) for name in producer.__all__)


def test_worker_exported_members() -> None:
    assert worker.__all__ == ["Handler", "WorkerSettings", "pad_batch", "save_model"]


def test_every_exported_member_exists_and_is_public() -> None:
    for package in (producer, worker):
        for name in package.__all__:
            assert not name.startswith("_") and hasattr(package, name), (package.__name__, name)
            member = getattr(package, name)
            if isinstance(member, type) or inspect.isfunction(
                member
            ):  # a class or function: defined in a public
                # module of the package, under its name
                module = member.__module__
                assert module.startswith(package.__name__ + "."), (package.__name__, name, module)
                assert not any(part.startswith("_") for part in module.split(".")), (name, module)
                assert member.__name__ == name, (name, member.__name__)
            else:  # a constant: a plain value, set
                assert isinstance(member, (str, int)) and member != "", (name, member)


def test_producer_does_not_import_the_worker() -> None:
    import subprocess
    import sys

    code = (
        "import sys, inferfleet, inferfleet.producer; "
        "assert not [m for m in sys.modules if m.split('.')[:2] == ['inferfleet', 'worker']]; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
