"""Every default of the producer SDK, in one place.

Both :class:`~inferfleet.producer.Producer` and
:class:`~inferfleet.producer.AsyncProducer` read their signatures' defaults
and their internal intervals from here, so the two cannot drift apart and
the docs have one place to be checked against.
"""

from __future__ import annotations

#: the queue a producer sends to when none is named
NAME = "default"
#: deadline of a request sent without one (None would mean no deadline)
DEADLINE_S: float | None = 60.0
#: what a send does over ``max_backlog``: "raise" QueueFull or "wait" for room
ON_FULL = "raise"
#: longest wait for room with ``on_full="wait"``
FULL_WAIT_S = 30.0
#: pause between two backlog reads while waiting for room
FULL_POLL_S = 0.02
#: how long a backlog read stands before the next send reads it again
BACKLOG_CACHE_S = 0.05
#: streams a queue is split into
SHARDS = 1
#: the lane a request goes to
PRIORITY = "normal"
#: longest wait for a reply (result, results) or for any next reply (map, imap)
TIMEOUT_S = 30.0
#: requests a map or imap keeps in flight
WINDOW = 2000
#: XADDs a submit_many round trip sends
CHUNK = 1000
#: longest blocking wait between rounds of a map
POLL_S = 0.05
#: longest wait of a results() round for the last reply it names (it returns when that comes)
WAIT_S = 1.0
#: how often a producer looks whether fleet-wide limits are in force (one EXISTS)
LIMITS_S = 1.0
