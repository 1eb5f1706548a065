"""Garbage-collector settings for a daemon that holds thousands of long-lived objects.

CPython's cyclic collector runs a young collection every `threshold[0]` net allocations of
container objects and, now and then, a full one that walks every tracked object. Everything
start-up built (modules, Twisted, the config, the site) lives until exit, and every waiting
request's objects (Request, channel, headers, Deferreds, timers, record) live for its whole
wait: at 5,000 waiters full collections walk them all again and again (`python -m bench.burst`,
the collector's time read through `gc.callbacks`: docs/performance.md). `gc.freeze()` moves
what start-up built out of every collection, and larger thresholds make collections rarer;
reference counting still frees almost everything at once, the collector is only for cycles.
"""

from __future__ import annotations

import gc

# Young collections every 10,000 net container allocations instead of 700 (a streamed request
# allocates a few hundred), and a full one only after 100 middle ones instead of 10.
THRESHOLDS = (10_000, 10, 100)


def tune_collector() -> None:
    """Call once start-up is done: collect its garbage, then freeze what is left."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
