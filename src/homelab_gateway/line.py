"""The order of the line: priority classes, aging, and fair share between clients (sans-IO).

`Line` decides which waiter a free slot goes to. It holds no timers and never reads a clock:
every call that depends on time takes `now`, so the policy is tested on plain numbers and the
Twisted limiter (`limiter.PositionedSemaphore`) stays a thin layer around it.

The order, best first:

1. **Class**: a waiter of a better class (`interactive` < `normal` < `batch`) goes first. A
   waiter that has waited `aging` seconds counts as one class better, and one more for every
   further `aging` seconds, so `batch` work is never starved by steady higher-class load.
2. **Fair share** between the clients of one (effective) class, measured in slot-seconds received
   (start-time fair queueing): each client has a virtual finish `F` that grows by the slot time
   it received divided by its weight; the client whose next start `max(V, F)` is lowest goes
   first, where `V` is the virtual time of the last grant. A client that was idle starts at `V`:
   it banks no credit for idleness, which is what "a recent window" means here. The slot time of
   a request is not known when it is granted, so the grant charges the client's running estimate
   and the release corrects the charge with the time the slot was really held.
3. **FIFO** within one client and one class.

With one client and one class every step above is a tie but the last: the line is a FIFO, and
every operation on it is O(1) except `order`, which is one O(n) walk.

What can move a waiter *back* (a higher position) matters to the limiter, which must say so at
once, so the line tells it, and the tests hold it to this:

- `join` moves back only those behind the newcomer in the new order: everyone ahead keeps
  their place. A newcomer that goes last moves nobody; `goes_last` tells that without a walk
  in the common cases.
- `pop` takes the head of `order` and leaves the rest in the same order.
- `leave` and `settle` can move anyone either way, but only while more than one client waits
  (one client's order is its classes and arrival times alone), and `settle` only when its own
  client still waits (a client's virtual finish places nothing but its own waiters). Both return
  whether they may have.
- Time moves nobody but at `next_aging`, when some waiter ages into a better class.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections import deque
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Generic, TypeVar

CLASSES = ("interactive", "normal", "batch")
DEFAULT_CLASS = "normal"
CLASS_RANK = {name: rank for rank, name in enumerate(CLASSES)}
# Slot-seconds a client's first request is assumed to hold before any has finished.
INITIAL_ESTIMATE = 1.0
ESTIMATE_SMOOTHING = 0.2  # weight of the newest hold time in a client's running estimate

T = TypeVar("T", bound=Hashable)


def effective_rank(rank: int, waited: float, aging: float | None) -> int:
    """The class a waiter is served as after waiting `waited` seconds."""
    if aging is None or waited < aging:
        return rank
    return max(0, rank - int(waited // aging))


@dataclass(slots=True)
class Waiter(Generic[T]):
    item: T
    client: str
    rank: int  # index into CLASSES
    arrived: float  # also the tie-break within a key; then the queues' order, as in `order`


_item = attrgetter("item")


@dataclass(slots=True)
class Grant:
    """What a granted waiter was charged, for `Line.settle` when its slot is released."""

    client: str
    rank: int  # the class it was served as (aging included)
    charged: float


@dataclass
class _Client:
    weight: float
    finish: float = 0.0  # virtual finish of its last grant
    estimate: float = INITIAL_ESTIMATE
    waiting: int = 0
    queues: dict[int, deque[Waiter]] = field(default_factory=dict)  # rank -> FIFO


class Line(Generic[T]):
    """Who is served next, and in what order everyone waiting would be served."""

    def __init__(self, *, aging: float | None = None, weights: Mapping[str, float] = {}) -> None:
        self.aging = aging
        self.weights = dict(weights)
        self._clients: dict[str, _Client] = {}
        self._waiters: dict[T, Waiter[T]] = {}
        self._virtual = 0.0
        self._queues = 0  # non-empty (client, class) FIFOs
        self._busy = 0  # clients with a waiter
        # For `goes_last`, kept up to date as the line changes: clients with more than one
        # waiter, waiters per class, the latest arrival (and how many joined at it), and the
        # waiting clients whose finish may be past V (a lazy max-heap: -finish, count, name).
        self._crowded = 0
        self._by_rank = [0] * len(CLASSES)
        self._latest = -math.inf
        self._at_latest = 0
        self._owing: list[tuple[float, int, str]] = []
        self._owed = 0

    def configure(self, *, aging: float | None, weights: Mapping[str, float]) -> None:
        """New aging and weights (config reload): waiters keep their place in their queues; the
        new weights apply to slot time charged from now on."""
        self.aging = aging
        self.weights = dict(weights)
        for name, state in self._clients.items():
            state.weight = self.weights.get(name, 1.0)

    def __len__(self) -> int:
        return len(self._waiters)

    def __contains__(self, item: object) -> bool:
        return item in self._waiters

    @property
    def queues(self) -> int:
        """Non-empty (client, class) FIFOs: with one, the line is that FIFO."""
        return self._queues

    def _client(self, name: str) -> _Client:
        client = self._clients.get(name)
        if client is None:
            client = self._clients[name] = _Client(weight=self.weights.get(name, 1.0))
        return client

    def waiting_for(self, client: str) -> int:
        found = self._clients.get(client)
        return 0 if found is None else found.waiting

    def join(self, item: T, client: str, rank: int, now: float) -> None:
        waiter = Waiter(item, client, rank, now)
        self._waiters[item] = waiter
        state = self._client(client)
        queue = state.queues.get(rank)
        if queue is None:
            queue = state.queues[rank] = deque()
            self._queues += 1
        queue.append(waiter)
        if not state.waiting:
            self._busy += 1
        state.waiting += 1
        if state.waiting == 1:
            self._owes(client, state)
        elif state.waiting == 2:
            self._crowded += 1
        self._by_rank[rank] += 1
        if now > self._latest:
            self._latest, self._at_latest = now, 1
        elif now == self._latest:
            self._at_latest += 1

    def leave(self, item: T) -> bool:
        """Remove a waiter that gave up (cancelled, timed out). O(its client's queue). True if
        that may have moved another waiter back: its client's later waiters and the virtual
        time it would have advanced no longer count, so others can pass one another."""
        waiter, state = self._unqueue(item)
        self._forget(state, waiter)
        return self._busy > 1

    def _unqueue(self, item: T) -> tuple[Waiter[T], _Client]:
        """Take a waiter out of its FIFO, wherever it stands. O(its client's queue)."""
        waiter = self._waiters.pop(item)
        state = self._clients[waiter.client]
        queue = state.queues[waiter.rank]
        if queue[0] is waiter:
            queue.popleft()
        else:
            queue.remove(waiter)
        return waiter, state

    def _forget(self, state: _Client, waiter: Waiter[T]) -> None:
        state.waiting -= 1
        if not state.waiting:
            self._busy -= 1
        elif state.waiting == 1:
            self._crowded -= 1
        self._by_rank[waiter.rank] -= 1
        if not state.queues[waiter.rank]:
            del state.queues[waiter.rank]
            self._queues -= 1
        if not state.waiting and not state.queues and state.finish <= self._virtual:
            # Idle and owing nothing: it would start at V anyway. Keeps the table small when
            # clients are peer addresses.
            del self._clients[waiter.client]

    def _best_head(self, now: float) -> tuple[tuple[int, float, float], Waiter[T]] | None:
        best: tuple[tuple[int, float, float], Waiter[T]] | None = None
        for state in self._clients.values():
            if not state.queues:
                continue
            start = max(self._virtual, state.finish)
            for queue in state.queues.values():
                head = queue[0]
                rank = effective_rank(head.rank, now - head.arrived, self.aging)
                key = (rank, start, head.arrived)
                if best is None or key < best[0]:
                    best = (key, head)
        return best

    def head(self, now: float) -> T | None:
        """The waiter `pop` would serve now, left in the line; None if nobody waits."""
        best = self._best_head(now)
        return None if best is None else best[1].item

    def pop(self, now: float) -> tuple[T, Grant] | None:
        """The waiter a free slot goes to now, charged the slot time its client is expected to
        hold; None if nobody waits."""
        best = self._best_head(now)
        if best is None:
            return None
        (rank, start, _), waiter = best
        state = self._clients[waiter.client]
        state.queues[waiter.rank].popleft()
        del self._waiters[waiter.item]
        self._virtual = max(self._virtual, start)
        state.finish = start + state.estimate / state.weight
        grant = Grant(waiter.client, rank, state.estimate)
        self._forget(state, waiter)
        self._owes(waiter.client, state)
        return waiter.item, grant

    def take(self, item: T, now: float) -> tuple[Grant, bool]:
        """Grant a waiter out of turn: a free slot that the waiters ahead of it cannot use
        (their replicas are others). Charged like `pop`; the virtual time stays, since those
        ahead were not served. Also True if that may have moved another waiter back (its
        client's later waiters, now that the client was charged)."""
        waiter, state = self._unqueue(item)
        start = max(self._virtual, state.finish)
        state.finish = start + state.estimate / state.weight
        grant = Grant(
            waiter.client,
            effective_rank(waiter.rank, now - waiter.arrived, self.aging),
            state.estimate,
        )
        self._forget(state, waiter)
        self._owes(waiter.client, state)
        return grant, self._busy > 1

    def arrived(self, item: T) -> tuple[str, int, float]:
        """A waiter's client, class and arrival, to move it to another line (a reload that
        joins two lines) without losing its place in time."""
        waiter = self._waiters[item]
        return waiter.client, waiter.rank, waiter.arrived

    def admit(self, client: str, rank: int, now: float) -> Grant:
        """A request that found a free slot: it skips the line but its service still counts."""
        state = self._client(client)
        start = max(self._virtual, state.finish)
        self._virtual = start
        state.finish = start + state.estimate / state.weight
        self._owes(client, state)
        return Grant(client, rank, state.estimate)

    def charging_moves(self, client: str) -> bool:
        """Whether charging `client` a grant (`admit`, `take`) may move a waiter back: only its
        own waiters move, and only past another client's."""
        state = self._clients.get(client)
        return state is not None and state.waiting > 0 and self._busy > 1

    def settle(self, grant: Grant, held: float) -> bool:
        """Correct a grant's charge with the time its slot was really held. True if that may
        have reordered the line: the client's finish and estimate place only its own waiters,
        so only when it has some and another client waits too."""
        state = self._client(grant.client)
        state.finish += (held - grant.charged) / state.weight
        state.estimate += ESTIMATE_SMOOTHING * (held - state.estimate)
        if not state.waiting:
            if state.finish <= self._virtual:
                del self._clients[grant.client]
            return False
        self._owes(grant.client, state)
        return self._busy > 1

    def _owes(self, name: str, state: _Client) -> None:
        """Note a waiting client whose finish is past V (`goes_last` looks at the largest);
        the heap is rebuilt when stale entries outnumber the clients that wait."""
        if not state.waiting or state.finish <= self._virtual:
            return
        self._owed += 1
        heapq.heappush(self._owing, (-state.finish, self._owed, name))
        if len(self._owing) > 2 * self._busy + 64:
            self._owing = [
                (-c.finish, n, name)
                for n, (name, c) in enumerate(self._clients.items())
                if c.waiting and c.finish > self._virtual
            ]
            heapq.heapify(self._owing)

    def goes_last(self, item: T, now: float) -> bool:
        """Whether `order(now)` ends with the waiter `item`, answered in O(1) amortized for
        the common case and False when unsure (then only a walk of the order knows): a
        newcomer that goes last moves nobody, and its place is the line's length.

        The case: `item` is its client's only waiter, no client waits twice (a client's
        second waiter would start after V), nobody of a worse class waits, no waiting client
        owes slot time, its own included (every start is V, and serving them keeps V), and it
        arrived last (on a tie, its client is the newest, as the order breaks ties). Then
        everyone else's key, when their turn comes, is a class no worse, V and an earlier
        arrival: thousands of clients waiting once each, as behind a reverse proxy, join
        without a walk of the order each."""
        waiter = self._waiters[item]
        state = self._clients[waiter.client]
        if state.waiting != 1 or self._crowded:
            return False
        rank = effective_rank(waiter.rank, now - waiter.arrived, self.aging)
        if any(self._by_rank[rank + 1 :]):
            return False
        if waiter.arrived != self._latest:
            return False
        if self._at_latest > 1 and next(reversed(self._clients)) != waiter.client:
            return False
        owing = self._owing
        while owing:
            finish, _, name = owing[0]
            client = self._clients.get(name)
            if (
                client is not None
                and client.waiting
                and client.finish == -finish
                and client.finish > self._virtual
            ):
                return False
            heapq.heappop(owing)
        return True

    def order(self, now: float) -> Iterator[T]:
        """Everyone waiting, in the order they would be served if nothing else arrived and no
        estimate changed: the position of a waiter is its index here plus one.

        One queue (one client, one class): a plain walk. Otherwise a merge of the per-client
        FIFOs on a heap of their heads, replaying `pop`'s choice on copies of the virtual
        clocks: O(n log q) for q queues.
        """
        queues = [
            (state, queue) for state in self._clients.values() for queue in state.queues.values()
        ]
        if len(queues) == 1:
            return map(_item, queues[0][1])
        return self._merged(queues, now)

    def _merged(self, queues: list[tuple[_Client, deque[Waiter[T]]]], now: float) -> Iterator[T]:
        virtual = self._virtual
        finish = {id(state): state.finish for state, _ in queues}
        heap: list[tuple[int, float, float, int, int]] = []
        for index, (state, queue) in enumerate(queues):
            head = queue[0]
            start = max(virtual, finish[id(state)])
            rank = effective_rank(head.rank, now - head.arrived, self.aging)
            heap.append((rank, start, head.arrived, index, 0))
        heapq.heapify(heap)
        while heap:
            rank, start, arrived, index, position = heap[0]
            state, queue = queues[index]
            current = max(virtual, finish[id(state)])
            if current > start:  # its client was served meanwhile: its key moved back
                heapq.heapreplace(heap, (rank, current, arrived, index, position))
                continue
            waiter = queue[position]
            yield waiter.item
            virtual = max(virtual, start)
            finish[id(state)] = start + state.estimate / state.weight
            if position + 1 < len(queue):
                after = queue[position + 1]
                rank = effective_rank(after.rank, now - after.arrived, self.aging)
                heapq.heapreplace(
                    heap,
                    (rank, max(virtual, finish[id(state)]), after.arrived, index, position + 1),
                )
            else:
                heapq.heappop(heap)

    def next_aging(self, now: float) -> float | None:
        """The first moment after `now` at which some waiter is served as a better class, if
        that can change the order (more than one queue waits): until then time moves nobody.
        Exact to the float, so that at the returned moment `order` has really changed."""
        if self.aging is None or self._queues < 2:
            return None
        aging = self.aging
        soonest: float | None = None
        for state in self._clients.values():
            for queue in state.queues.values():
                rank = queue[0].rank
                for steps in range(1, rank + 1):
                    # The FIFO is in arrival order, so those that waited `steps` periods are a
                    # prefix; the first after it is the next to cross that many.
                    better = rank - steps
                    first = bisect_left(
                        queue,
                        True,
                        key=lambda w: effective_rank(rank, now - w.arrived, aging) > better,
                    )
                    if first == len(queue):
                        continue
                    at = _crossing(queue[first], better, steps * aging, aging)
                    if soonest is None or at < soonest:
                        soonest = at
        return soonest

    def next_crossing(self, item: T, now: float) -> float | None:
        """The first moment after `now` at which the waiter `item` is served as a better
        class: all that a newcomer adds to `next_aging`, without looking at anyone else."""
        if self.aging is None:
            return None
        waiter = self._waiters[item]
        for steps in range(1, waiter.rank + 1):
            at = _crossing(waiter, waiter.rank - steps, steps * self.aging, self.aging)
            if at > now:
                return at
        return None

    def waiting_by_class(self, now: float) -> dict[str, int]:
        """Waiters per class they would be served as now (aging included)."""
        counts = dict.fromkeys(CLASSES, 0)
        for waiter in self._waiters.values():
            counts[CLASSES[effective_rank(waiter.rank, now - waiter.arrived, self.aging)]] += 1
        return counts

    def oldest_arrival(self) -> float | None:
        """When the longest-waiting waiter joined, O(1): waiters are kept in joining order."""
        first = next(iter(self._waiters.values()), None)
        return None if first is None else first.arrived

    def waiting_by_client(self) -> dict[str, int]:
        return {name: state.waiting for name, state in self._clients.items() if state.waiting}


def _crossing(waiter: Waiter, better: int, after: float, aging: float) -> float:
    """The first float moment at which `waiter` is served as class `better`, about `after`
    seconds after it arrived: `effective_rank` decides, not the arithmetic."""

    def crossed(at: float) -> bool:
        return effective_rank(waiter.rank, at - waiter.arrived, aging) <= better

    at = waiter.arrived + after
    while not crossed(at):
        at = math.nextafter(at, math.inf)
    while crossed(earlier := math.nextafter(at, -math.inf)):
        at = earlier
    return at
