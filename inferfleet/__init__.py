"""inferfleet: PyTorch models served by a fleet of inference workers fed by Redis Streams.

The producer SDK is the public API of this package; it never imports the
worker (or torch)::

    from inferfleet import Producer
    with Producer("redis://localhost:6379/0", "ctr") as p:
        reply = p.result(p.submit(features), timeout_s=5)

The two sides are subpackages: :mod:`inferfleet.producer` (the SDK and the
wire format, folder ``producer/``) and :mod:`inferfleet.worker` (the fleet,
folder ``worker/``, installed with the ``worker`` extra).
"""

from __future__ import annotations

from inferfleet.producer import *  # noqa: F403 - the package's API is the SDK's, pinned by its __all__
from inferfleet.producer import __all__ as __all__
