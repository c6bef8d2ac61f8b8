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

import os as _os

# In a checkout (pyproject.toml of inferfleet beside producer/ and worker/), the subpackages
# live next to this folder: add the checkout to this package's path, so that the folder works as
# the whole package from the checkout's root (``python -m inferfleet``, ``python -c``) with
# nothing installed, or with another copy installed, which this one shadows there anyway.
# Installed from a wheel, producer/ and worker/ are inside this folder and nothing is added.
_here = _os.path.dirname(_os.path.abspath(__file__))
_checkout = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "producer")) and all(
    _os.path.isfile(_os.path.join(_checkout, *parts, "__init__.py"))
    for parts in (("producer",), ("worker",))
):
    __path__.append(_checkout)
del _os, _here, _checkout

# after the path above: the SDK may only be found through it
from inferfleet.producer import *  # noqa: E402, F403 - the package's API is the SDK's (its __all__)
from inferfleet.producer import __all__ as __all__  # noqa: E402
