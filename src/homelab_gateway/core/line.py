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
every operation on it is O(1) except `order`, which is one O(n) walk. With q (client, class)
FIFOs waiting, `head` and `pop` (and the bookkeeping of `join`, `leave`, `take`, `admit` and
`settle`) are O(log n) amortized, on heaps of the FIFOs' heads and of the waiters' aging
crossings, not a walk of every client: many distinct clients (peer addresses) waiting at once
do not make each grant slower. So is `next_aging`, and so is each of the first waiters of
`leading` (the order found lazily on those heaps, for a walk that stops after a few). Only a
clock that went back past a crossing falls back to a walk (O(q), O(n) for `next_aging`), for
that call.

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
import struct
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
    seq: int  # creation order: the order of `Line._clients`, which breaks ties
    finish: float = 0.0  # virtual finish of its last grant
    estimate: float = INITIAL_ESTIMATE
    waiting: int = 0
    queues: dict[int, _Fifo] = field(default_factory=dict)  # rank -> FIFO


class _Fifo(deque[Waiter]):
    """One client's FIFO of one class, with what the heaps of heads know of it."""

    __slots__ = ("client", "rank", "seq", "stamp")

    def __init__(self, client: _Client, seq: int) -> None:
        super().__init__()
        self.client = client
        self.seq = seq  # creation order: the order of `client.queues`, which breaks ties
        self.rank = 0  # the class its head is served as at `Line._aged`
        self.stamp = 0  # its one live entry on a heap of heads (0: none)


class Line(Generic[T]):
    """Who is served next, and in what order everyone waiting would be served.

    The head of the line is the least `(class, start, arrived)` key of the FIFOs' heads, the
    first one in `order`'s walk on a tie. While more than one FIFO waits, two heaps of heads
    keep it, so that a grant is O(log q) amortized for q FIFOs, not a walk of every client:

    - `_even` holds the heads whose client starts at the virtual time V (its finish is not
      past it), keyed `(class, arrived, tie)`: their start is V, whatever V has become;
    - `_owing` the others, keyed `(class, finish, arrived, tie)`: their start is that finish.

    Within a class the least of `_even` goes before the least of `_owing`, whose start is
    later. V only grows, so a head can only have to move from `_owing` to `_even`, and those
    that must are the least of `_owing`: they move when they surface. The tie is the creation
    order of the client and then of the FIFO, the order of the dicts that `order` walks. A new
    head, class or client finish pushes a new entry for the FIFO under a new stamp; the older
    one is stale and dropped when it surfaces (or when stale entries outnumber live ones).

    Aging: `_ages` holds, for every waiter that can still age, when it is next served as a
    better class after `_aged`: a lower bound at first (cheap, and most waiters are served
    before it comes), made exact (`_crossing`) when it surfaces, or at once if it would surface
    at once (the limiter asks `next_aging` after every join). Choosing at `now` first moves
    the heads whose crossing came by `now` to their better class; the least exact moment left
    is `next_aging`.
    """

    def __init__(self, *, aging: float | None = None, weights: Mapping[str, float] = {}) -> None:
        self.aging = aging
        self.weights = dict(weights)
        self._clients: dict[str, _Client] = {}
        self._waiters: dict[T, Waiter[T]] = {}
        self._virtual = 0.0
        self._queues = 0  # non-empty (client, class) FIFOs
        self._busy = 0  # clients with a waiter
        self._sole: _Fifo | None = None  # the FIFO, while there is one: no heap is kept then
        self._made = 0  # clients and FIFOs created: their `seq`
        self._stamps = 0  # entries pushed on the heaps: their stamp, unique
        self._even: list[tuple[int, float, int, int, int, _Fifo]] = []
        self._owing: list[tuple[int, float, float, int, int, int, _Fifo]] = []
        # (moment, stamp, waiter, the class it is then served as, whether moment is exact)
        self._ages: list[tuple[float, int, Waiter[T], int, bool]] = []
        self._aged = -math.inf  # the moment the heads' classes (`_Fifo.rank`) are at
        # No waiter crossed into a better class after this and up to `_aged`: at a `now`
        # before it (a clock that went back) the heads' classes may not be those at `_aged`.
        self._crossed = -math.inf
        # For `goes_last`, kept up to date as the line changes: clients with more than one
        # waiter, waiters per class, the latest arrival (and how many joined at it), and the
        # waiting clients whose finish may be past V (a lazy max-heap: -finish, count, client).
        self._crowded = 0
        self._by_rank = [0] * len(CLASSES)
        self._latest = -math.inf
        self._at_latest = 0
        self._late: list[tuple[float, int, _Client]] = []
        self._lates = 0

    def configure(self, *, aging: float | None, weights: Mapping[str, float]) -> None:
        """New aging and weights (config reload): waiters keep their place in their queues; the
        new weights apply to slot time charged from now on."""
        reaged = aging != self.aging
        self.aging = aging
        self.weights = dict(weights)
        for name, state in self._clients.items():
            state.weight = self.weights.get(name, 1.0)
        if reaged:
            self._reage()

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
            self._made += 1
            client = self._clients[name] = _Client(self.weights.get(name, 1.0), self._made)
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
            self._made += 1
            queue = state.queues[rank] = _Fifo(state, self._made)
            queue.append(waiter)
            self._queues += 1
            if self._queues == 1:
                self._sole = queue
            else:
                sole, self._sole = self._sole, None
                if sole is not None:  # a second FIFO: the heaps start with both
                    self._headed(sole)
                self._headed(queue)
        else:
            queue.append(waiter)
        if self.aging is not None:
            aged = self._rank_at(waiter, self._aged)
            if aged != rank:  # it crossed before `_aged` (it waited in another line)
                self._crossed = self._aged
            self._will_age(waiter, aged)
        if not state.waiting:
            self._busy += 1
        state.waiting += 1
        if state.waiting == 1:
            self._owes(state)
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
        waiter, state, headed = self._unqueue(item)
        if headed is not None:
            self._headed(headed)
        self._forget(state, waiter)
        return self._busy > 1

    def _unqueue(self, item: T) -> tuple[Waiter[T], _Client, _Fifo | None]:
        """Take a waiter out of its FIFO, wherever it stands. O(its client's queue). Also its
        FIFO if that has a new head."""
        waiter = self._waiters.pop(item)
        state = self._clients[waiter.client]
        queue = state.queues[waiter.rank]
        if queue[0] is waiter:
            queue.popleft()
            if queue:
                return waiter, state, queue
        else:
            queue.remove(waiter)
        return waiter, state, None

    def _forget(self, state: _Client, waiter: Waiter[T]) -> None:
        state.waiting -= 1
        if not state.waiting:
            self._busy -= 1
        elif state.waiting == 1:
            self._crowded -= 1
        self._by_rank[waiter.rank] -= 1
        if not state.queues[waiter.rank]:
            state.queues[waiter.rank].stamp = 0  # its entry on a heap of heads is stale
            del state.queues[waiter.rank]
            self._queues -= 1
            if self._queues <= 1:  # the one left, if any, is the line: no heap is kept
                self._sole = self._least()
                self._even.clear()
                self._owing.clear()
            else:
                self._tidy()
        if not state.waiting and not state.queues and state.finish <= self._virtual:
            # Idle and owing nothing: it would start at V anyway. Keeps the table small when
            # clients are peer addresses.
            del self._clients[waiter.client]
        if len(self._ages) > 2 * len(self._waiters) + 64:
            self._ages = [entry for entry in self._ages if self._live(entry[2])]
            heapq.heapify(self._ages)

    def _live(self, waiter: Waiter[T]) -> bool:
        return self._waiters.get(waiter.item) is waiter

    def _rank_at(self, waiter: Waiter[T], at: float) -> int:
        return effective_rank(waiter.rank, at - waiter.arrived, self.aging)

    def _headed(self, queue: _Fifo) -> None:
        """`queue` has a new head (or the heaps are new): its class at `_aged`, and its entry."""
        queue.rank = self._rank_at(queue[0], self._aged)
        self._push(queue)

    def _push(self, queue: _Fifo) -> None:
        """Put `queue`'s head on the heap of heads that its client's finish puts it on, under a
        new stamp (its older entry goes stale): its head, class or client's finish changed.
        Nothing while it is the only FIFO."""
        if self._sole is not None:
            return
        self._stamps += 1
        stamp = queue.stamp = self._stamps
        state = queue.client
        arrived = queue[0].arrived
        if state.finish <= self._virtual:
            heapq.heappush(self._even, (queue.rank, arrived, state.seq, queue.seq, stamp, queue))
        else:
            heapq.heappush(
                self._owing,
                (queue.rank, state.finish, arrived, state.seq, queue.seq, stamp, queue),
            )
        self._tidy()

    def _tidy(self) -> None:
        """Drop the stale entries of the heaps of heads once they outnumber the live ones (and
        64): O(1) amortized, and the heaps stay O(q)."""
        if len(self._even) + len(self._owing) > 2 * self._queues + 64:
            self._even = [entry for entry in self._even if entry[-2] == entry[-1].stamp]
            self._owing = [entry for entry in self._owing if entry[-2] == entry[-1].stamp]
            heapq.heapify(self._even)
            heapq.heapify(self._owing)

    def _charged(self, state: _Client) -> None:
        """`state`'s finish changed, and its heads' start with it."""
        for queue in state.queues.values():
            self._push(queue)
        self._owes(state)

    def _owes(self, state: _Client) -> None:
        """Note a waiting client whose finish is past V (`goes_last` looks at the largest);
        the heap is rebuilt when stale entries outnumber the clients that wait."""
        if not state.waiting or state.finish <= self._virtual:
            return
        self._lates += 1
        heapq.heappush(self._late, (-state.finish, self._lates, state))
        if len(self._late) > 2 * self._busy + 64:
            self._late = [
                (-c.finish, n, c)
                for n, c in enumerate(self._clients.values())
                if c.waiting and c.finish > self._virtual
            ]
            heapq.heapify(self._late)

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
        rank = self._rank_at(waiter, now)
        if any(self._by_rank[rank + 1 :]):
            return False
        if waiter.arrived != self._latest:
            return False
        if self._at_latest > 1 and next(reversed(self._clients)) != waiter.client:
            return False
        late = self._late
        while late:
            finish, _, client = late[0]
            if client.waiting and client.finish == -finish and client.finish > self._virtual:
                return False
            heapq.heappop(late)
        return True

    def _will_age(self, waiter: Waiter[T], rank: int) -> None:
        """Note when `waiter`, served as `rank` at `_aged`, is next served as a better class:
        a lower bound of that moment, far enough below the sum for its rounding (it is off by
        about one float; the bound is some 4,500 below, 1.8 ms at an epoch clock); or the
        moment itself if the bound would come before the least exact one: `next_aging`, which
        the limiter asks after every join, would make it exact at once, after it climbed to
        the top of the heap, and send it back down (waiters joining at one instant tie)."""
        if rank and self.aging is not None:
            after = (waiter.rank - rank + 1) * self.aging
            at = waiter.arrived + after - (abs(waiter.arrived) + after) * 1e-12
            ages, exact = self._ages, False
            if ages and ages[0][4] and at < ages[0][0]:
                at, exact = _crossing(waiter, rank - 1, after, self.aging), True
            self._stamps += 1
            heapq.heappush(ages, (at, self._stamps, waiter, rank - 1, exact))

    def _exact(self, entry: tuple[float, int, Waiter[T], int, bool]) -> float:
        waiter, better, aging = entry[2], entry[3], self.aging
        assert aging is not None
        return _crossing(waiter, better, (waiter.rank - better) * aging, aging)

    def _age(self, now: float) -> bool:
        """Bring the heads' classes to `now`, if that is not before `_aged`: each waiter whose
        crossing came is noted again for its next, and a head moves to its better class.
        O(log n) per crossing. True if the heads' classes are then those at `now`: false only
        for a `now` before the last crossing (a clock that went back over it)."""
        if now < self._aged:
            return now >= self._crossed
        self._aged = now
        ages = self._ages
        while ages and ages[0][0] <= now:
            entry = ages[0]
            waiter = entry[2]
            if not self._live(waiter):
                heapq.heappop(ages)
                continue
            if not entry[4]:
                at = self._exact(entry)
                if at > now:  # not yet: it waits on the heap at its exact moment
                    heapq.heapreplace(ages, (at, entry[1], waiter, entry[3], True))
                    continue
            else:
                at = entry[0]
            heapq.heappop(ages)
            self._crossed = max(self._crossed, at)
            rank = self._rank_at(waiter, now)
            self._will_age(waiter, rank)
            queue = self._clients[waiter.client].queues[waiter.rank]
            if queue[0] is waiter and queue.rank != rank:
                queue.rank = rank
                self._push(queue)
        return True

    def _reage(self) -> None:
        """Every head's class and every waiter's next crossing afresh, at `_aged`: the aging
        period changed."""
        self._crossed = self._aged
        self._ages = []
        for waiter in self._waiters.values():
            self._will_age(waiter, self._rank_at(waiter, self._aged))
        self._even.clear()
        self._owing.clear()
        for state in self._clients.values():
            for queue in state.queues.values():
                self._headed(queue)

    def _least(self) -> _Fifo | None:
        """The FIFO of the least head on the heaps, once stale entries and heads whose client
        V caught up with are out of the way. O(log q) amortized."""
        virtual = self._virtual
        even, owing = self._even, self._owing
        while owing:
            top = owing[0]
            if top[-2] != top[-1].stamp:
                heapq.heappop(owing)
            elif top[1] <= virtual:  # its client starts at V now
                heapq.heappop(owing)
                heapq.heappush(even, (top[0], *top[2:]))
            else:
                break
        while even and even[0][-2] != even[0][-1].stamp:
            heapq.heappop(even)
        if even and (not owing or even[0][0] <= owing[0][0]):
            return even[0][-1]
        return owing[0][-1] if owing else None

    def _best_head(self, now: float) -> _Fifo | None:
        """The FIFO whose head goes first at `now`."""
        if self._sole is not None:
            return self._sole
        if not self._age(now):
            return self._walked_head(now)
        return self._least()

    def _walked_head(self, now: float) -> _Fifo | None:
        """`_best_head` by a walk of every FIFO, O(q): for a `now` at which the heads'
        classes are not kept (`_age`)."""
        best: tuple[tuple[int, float, float], _Fifo] | None = None
        for state in self._clients.values():
            if not state.queues:
                continue
            start = max(self._virtual, state.finish)
            for queue in state.queues.values():
                head = queue[0]
                key = (self._rank_at(head, now), start, head.arrived)
                if best is None or key < best[0]:
                    best = (key, queue)
        return None if best is None else best[1]

    def head(self, now: float) -> T | None:
        """The waiter `pop` would serve now, left in the line; None if nobody waits."""
        queue = self._best_head(now)
        return None if queue is None else queue[0].item

    def pop(self, now: float) -> tuple[T, Grant] | None:
        """The waiter a free slot goes to now, charged the slot time its client is expected to
        hold; None if nobody waits."""
        queue = self._best_head(now)
        if queue is None:
            return None
        waiter = queue.popleft()
        state = queue.client
        start = max(self._virtual, state.finish)
        del self._waiters[waiter.item]
        self._virtual = start
        state.finish = start + state.estimate / state.weight
        grant = Grant(waiter.client, self._rank_at(waiter, now), state.estimate)
        if queue and self._sole is None:
            queue.rank = self._rank_at(queue[0], self._aged)
        self._forget(state, waiter)
        self._charged(state)
        return waiter.item, grant

    def take(self, item: T, now: float) -> tuple[Grant, bool]:
        """Grant a waiter out of turn: a free slot that the waiters ahead of it cannot use
        (their replicas are others). Charged like `pop`; the virtual time stays, since those
        ahead were not served. Also True if that may have moved another waiter back (its
        client's later waiters, now that the client was charged)."""
        waiter, state, headed = self._unqueue(item)
        if headed is not None:  # its entry goes on a heap with the client's new finish
            headed.rank = self._rank_at(headed[0], self._aged)
        start = max(self._virtual, state.finish)
        state.finish = start + state.estimate / state.weight
        grant = Grant(
            waiter.client,
            effective_rank(waiter.rank, now - waiter.arrived, self.aging),
            state.estimate,
        )
        self._forget(state, waiter)
        self._charged(state)
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
        self._charged(state)
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
        self._charged(state)
        return self._busy > 1

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

    def leading(self, now: float) -> Iterator[T]:
        """`order(now)`, the same waiters in the same order, found lazily on the heaps of heads:
        the first k cost O(k log k) amortized, where `order` spends O(q) on a heap of every
        FIFO's head before it yields the first. For a walk that stops after a few (the shared
        line's claims: a free slot or two, for the first waiters not yet claimed for).

        It replays `pop` as `_merged` does, over the live heaps without changing them: a
        frontier heap holds their entries reached so far, each under a key that is a lower
        bound of its head's key in the replay (V and the clients' finishes only grow), and
        children enter when their parent leaves it, so a heap's order is kept. An entry whose
        key grew is put back under its true key; the FIFOs the replay took from, and the
        clients it charged, are kept aside (`taken`, `finish`). A `now` at which the heads'
        classes are not kept (a clock that went back, `_age`) falls back to `order`. As with
        `order`, the line must not change while the walk goes on.
        """
        if self._sole is not None:
            return map(_item, self._sole)
        if not self._queues or not self._age(now):
            return self.order(now)
        return self._lazily(now)

    def _lazily(self, now: float) -> Iterator[T]:
        virtual = self._virtual
        even, owing = self._even, self._owing
        finish: dict[int, float] = {}  # id of a client charged in the replay -> its finish
        taken: dict[int, int] = {}  # id of a FIFO the replay took from -> how many
        tick = 0  # a unique last key, so that entries never compare their FIFOs
        # (class, start, arrived, client seq, FIFO seq, tick, source, where): source 0 and 1
        # are `_even` and `_owing` at index `where`, 2 a FIFO (`where`) the replay moved on.
        frontier: list[tuple[int, float, float, int, int, int, int, object]] = []

        def reach(source: int, index: int) -> None:
            nonlocal tick
            heap = owing if source else even
            if index >= len(heap):
                return
            entry = heap[index]
            tick += 1
            if not source:
                key = (entry[0], virtual, *entry[1:4])
            elif entry[1] > virtual:
                key = entry[:5]
            else:  # its client starts at V: below every key of its class, whatever it arrived
                key = (entry[0], virtual, -math.inf, 0, 0)
            heapq.heappush(frontier, (*key, tick, source, index))

        def keyed(queue: _Fifo, at: int) -> tuple[int, float, float, int, int]:
            state, waiter = queue.client, queue[at]
            start = max(virtual, finish.get(id(state), state.finish))
            return (self._rank_at(waiter, now), start, waiter.arrived, state.seq, queue.seq)

        reach(0, 0)
        reach(1, 0)
        while frontier:
            top = frontier[0]
            source, where = top[6], top[7]
            if source == 2:
                assert isinstance(where, _Fifo)
                queue, at = where, taken[id(where)]
            else:
                heapq.heappop(frontier)
                assert isinstance(where, int)
                reach(source, 2 * where + 1)
                reach(source, 2 * where + 2)
                entry = (owing if source else even)[where]
                queue, at = entry[-1], 0
                if entry[-2] != queue.stamp or id(queue) in taken:  # stale, or replayed aside
                    continue
            key = keyed(queue, at)
            if key > top[:5]:  # its start moved on (or its bound was low): back under it
                tick += 1
                if source == 2:
                    heapq.heapreplace(frontier, (*key, tick, 2, queue))
                else:
                    heapq.heappush(frontier, (*key, tick, 2, queue))
                taken.setdefault(id(queue), 0)
                continue
            if source == 2:
                heapq.heappop(frontier)
            yield queue[at].item
            state = queue.client
            virtual = key[1]
            finish[id(state)] = key[1] + state.estimate / state.weight
            taken[id(queue)] = at + 1
            if at + 1 < len(queue):
                tick += 1
                heapq.heappush(frontier, (*keyed(queue, at + 1), tick, 2, queue))

    def next_aging(self, now: float) -> float | None:
        """The first moment after `now` at which some waiter is served as a better class, if
        that can change the order (more than one queue waits): until then time moves nobody.
        Exact to the float, so that at the returned moment `order` has really changed.
        O(log n) amortized: the least crossing left once those up to `now` are passed."""
        if self.aging is None or self._queues < 2:
            return None
        if not self._age(now):
            return self._walked_aging(now, self.aging)
        ages = self._ages
        while ages:
            entry = ages[0]
            if not self._live(entry[2]):
                heapq.heappop(ages)
            elif not entry[4]:
                heapq.heapreplace(ages, (self._exact(entry), *entry[1:4], True))
            else:
                return entry[0]
        return None

    def _walked_aging(self, now: float, aging: float) -> float | None:
        """`next_aging` by a walk of every waiter, O(n): for a `now` at which the crossings
        are not kept (`_age`)."""
        soonest: float | None = None
        for waiter in self._waiters.values():
            rank = self._rank_at(waiter, now)
            if rank:
                at = _crossing(waiter, rank - 1, (waiter.rank - rank + 1) * aging, aging)
                if soonest is None or at < soonest:
                    soonest = at
        return soonest

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
    seconds after it arrived: `effective_rank` decides, not the arithmetic.

    The sum is off by a few floats at most, but those can be tiny: near 0 (a test's clock) a
    walk from it float by float down to the first crossed one would take longer than the age
    of the universe. So it gallops from the sum to a moment on each side, then bisects, over
    the floats in order (`_ordered`)."""

    def crossed(moment: int) -> bool:
        return effective_rank(waiter.rank, _float(moment) - waiter.arrived, aging) <= better

    step, estimate = 1, _ordered(waiter.arrived + after)
    if crossed(estimate):
        high = estimate
        while crossed(low := high - step):
            high, step = low, step * 2
    else:
        low = estimate
        while not crossed(high := low + step):
            low, step = high, step * 2
    while high - low > 1:  # crossed at `high`, not at `low`
        middle = (low + high) // 2
        if crossed(middle):
            high = middle
        else:
            low = middle
    return _float(high)


_DOUBLE, _BITS = struct.Struct("<d"), struct.Struct("<q")
_SIGN = 1 << 63


def _ordered(value: float) -> int:
    """`value`'s place among the floats: consecutive floats are consecutive integers (both
    zeros are 0)."""
    (bits,) = _BITS.unpack(_DOUBLE.pack(value))
    return bits if bits >= 0 else -(bits + _SIGN)


def _float(place: int) -> float:
    """The float at `place` (`_ordered`'s inverse)."""
    (value,) = _DOUBLE.unpack(_BITS.pack(place if place >= 0 else -place - _SIGN))
    return value
