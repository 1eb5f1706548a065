"""The order of the line: priority classes, aging, and fair share between clients (sans-IO).

`Line` decides which waiter a free slot goes to. It holds no timers and never reads a clock:
every call that depends on time takes `now`, and time inside the line never goes back (a
`now` before one it has seen counts as that one), so the policy is tested on plain numbers.

The order, best first:

1. **Class**: a waiter of a better class (`interactive` < `normal` < `batch`) goes first. A
   waiter that has waited `aging` seconds counts as one class better, and one more for every
   further `aging` seconds, so `batch` work is never starved by steady higher-class load.
2. **Fair share** between the clients of one (effective) class, measured in slot-seconds received
   (start-time fair queueing): each client has a virtual finish `F` that grows by the slot time
   it received divided by its weight; the client whose next start `max(V, F)` is lowest goes
   first, where `V` is the virtual time of the last grant in turn. A client that was idle starts
   at `V`: it banks no credit for idleness. The slot time of a request is not known when it is
   granted, so the grant charges the client's running estimate and `settle` corrects it.
3. **FIFO** within one client and one class.

`place` writes this order as one key, and is the one function to change for another policy.

What can move a waiter *back* (a higher position) matters to the limiter, which must say so at
once, so the line tells it: `join` moves back only those behind the newcomer; a grant of the
head moves nobody; `leave`, `settle` and a grant out of turn return whether they may have;
time moves nobody but at `next_aging`.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Generic, TypeVar

CLASSES = ("interactive", "normal", "batch")
DEFAULT_CLASS = "normal"
CLASS_RANK = {name: rank for rank, name in enumerate(CLASSES)}
# Slot-seconds a client's first request is assumed to hold before any has finished.
INITIAL_ESTIMATE = 1.0
ESTIMATE_SMOOTHING = 0.2  # weight of the newest hold time in a client's running estimate

T = TypeVar("T", bound=Hashable)


def aged_at(arrived: float, steps: int, aging: float) -> float:
    """The moment a waiter that arrived at `arrived` is served `steps` classes better."""
    return arrived + steps * aging


def served_as(rank: int, arrived: float, now: float, aging: float | None) -> int:
    """The class a waiter of class `rank` is served as at `now`: one better for each moment
    `aged_at` that has come, so that a timer set at that moment finds it crossed."""
    if aging is None or not rank:
        return rank
    waited = now - arrived
    if waited >= rank * aging:
        steps = rank
    elif waited < aging:
        steps = 0
    else:
        steps = int(waited // aging)
    while steps < rank and aged_at(arrived, steps + 1, aging) <= now:
        steps += 1
    while steps and aged_at(arrived, steps, aging) > now:
        steps -= 1
    return rank - steps


@dataclass(slots=True)
class Waiter(Generic[T]):
    item: T
    client: str
    rank: int  # index into CLASSES
    arrived: float  # its place's tie-break (`place`)


_item = attrgetter("item")


@dataclass(slots=True)
class Grant:
    """What a granted waiter was charged, for `Line.settle` when its slot is released."""

    client: str
    rank: int  # the class it was served as (aging included)
    charged: float


@dataclass
class _Client:
    name: str
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
        self.rank = 0  # the class its head is served as at `Line._now`
        self.stamp = 0  # its one live entry on a heap of heads (0: none)


Place = tuple[int, float, float, int, int]
AT_V = -math.inf
"""The start a head of `Line._at_v` is keyed with: its client starts at V, whatever V becomes,
and all of them alike, so any one value orders them as V would."""


def place(served: int, start: float, waiter: Waiter[Any], client: _Client, queue: _Fifo) -> Place:
    """Where `waiter`, of `client`'s FIFO `queue`, stands in the line: the least place goes
    first. `served` is the class it is served as now (aging included), `start` its client's
    next start in the fair share (`max(V, finish)`). The order of the module docstring, ties
    broken by the clients' and then the FIFOs' creation order.

    `Line` keeps places in heaps and replays them, which needs two things of this key: a place
    never goes down as `start` grows (V and the finishes only grow), and the order of two
    places with one start does not depend on that start."""
    return (served, start, waiter.arrived, client.seq, queue.seq)


class Line(Generic[T]):
    """Who is served next, and in what order everyone waiting would be served.

    The head of the line is the least `place` of the FIFOs' heads. Two heaps of heads keep it,
    entries `(place, stamp, FIFO)`, so that a grant does not walk every client
    (`python -m bench.line`: 5,000 distinct clients waiting once each):

    - `_at_v` holds the heads whose client starts at the virtual time V (its finish is not
      past it), placed with the start `AT_V`, since it is V for all of them, whatever V becomes;
    - `_owing` the others, placed with their start, their client's finish.

    V only grows, so a head can only have to move from `_owing` to `_at_v`, when it surfaces.
    A changed head, class or finish pushes a new entry under a new stamp; the older one is
    stale and dropped when it surfaces (or when stale entries outnumber live ones).

    `_ages` holds, for every waiter that can still age, the moment (`aged_at`) it is next
    served as a better class: choosing at `now` first moves the heads whose moment came, and
    `next_aging`, which the limiter asks after every join, is a look at its top, not a walk of
    every waiter (`python -m bench.line`: about 1 us at 5,000 waiters).
    """

    def __init__(self, *, aging: float | None = None, weights: Mapping[str, float] = {}) -> None:
        self.aging = aging
        self.weights = dict(weights)
        self._clients: dict[str, _Client] = {}
        self._waiters: dict[T, Waiter[T]] = {}
        self._virtual = 0.0
        self._queues = 0  # non-empty (client, class) FIFOs
        self._busy = 0  # clients with a waiter
        self._created = 0  # clients and FIFOs created: their `seq`
        self._stamps = 0  # entries pushed on the heaps: their stamp, unique
        self._at_v: list[tuple[Place, int, _Fifo]] = []
        self._owing: list[tuple[Place, int, _Fifo]] = []
        self._ages: list[tuple[float, int, Waiter[T]]] = []  # (moment, stamp, waiter)
        self._now = -math.inf  # the latest `now` seen: the heads' classes are those at it
        # For `is_last`: clients waiting more than once, and the entry of `_at_v` with the
        # highest place (found again by a walk of `_at_v` once it is stale).
        self._crowded = 0
        self._highest: tuple[Place, int, _Fifo] | None = None

    def configure(self, *, aging: float | None, weights: Mapping[str, float]) -> None:
        """New aging and weights (config reload): waiters keep their place in their queues; the
        new weights apply to slot time charged from now on."""
        reaged = aging != self.aging
        self.aging = aging
        self.weights = dict(weights)
        for name, state in self._clients.items():
            state.weight = self.weights.get(name, 1.0)
        if reaged:
            self._ages = []
            for waiter in self._waiters.values():
                self._will_age(waiter)
            self._at_v.clear()
            self._owing.clear()
            for state in self._clients.values():
                for queue in state.queues.values():
                    self._new_head(queue)

    def __len__(self) -> int:
        return len(self._waiters)

    def __contains__(self, item: object) -> bool:
        return item in self._waiters

    @property
    def queues(self) -> int:
        """Non-empty (client, class) FIFOs: with one, the line is that FIFO."""
        return self._queues

    def waiting_for(self, client: str) -> int:
        found = self._clients.get(client)
        return 0 if found is None else found.waiting

    def _client(self, name: str) -> _Client:
        client = self._clients.get(name)
        if client is None:
            self._created += 1
            client = self._clients[name] = _Client(name, self.weights.get(name, 1.0), self._created)
        return client

    def join(self, item: T, client: str, rank: int, now: float) -> bool:
        """`item` waits from `now`: earlier for a waiter moved from another line or joining
        again after Redis was away, which goes by its arrival among its client's. True if it
        is the last of its client's class (False: those behind it moved back)."""
        waiter = Waiter(item, client, rank, now)
        self._waiters[item] = waiter
        last = True
        state = self._client(client)
        queue = state.queues.get(rank)
        if queue is None:
            self._created += 1
            queue = state.queues[rank] = _Fifo(state, self._created)
            queue.append(waiter)
            self._queues += 1
            self._new_head(queue)
        elif queue[-1].arrived <= now:
            queue.append(waiter)
        else:
            at = len(queue) - 1
            while at and queue[at - 1].arrived > now:
                at -= 1
            queue.insert(at, waiter)
            if not at:
                self._new_head(queue)
            last = False
        self._will_age(waiter)
        if not state.waiting:
            self._busy += 1
        state.waiting += 1
        if state.waiting == 2:
            self._crowded += 1
        return last

    def leave(self, item: T) -> bool:
        """Remove a waiter that gave up (cancelled, timed out). True if that may have moved
        another waiter back: its client's later waiters and the virtual time it would have
        advanced no longer count, so others can pass one another."""
        state, headed = self._unqueue(self._waiters[item])
        if headed is not None:
            self._push(headed)
        self._forget_if_idle(state)
        return self._busy > 1

    def grant(self, now: float, item: T | None = None) -> tuple[T, Grant, bool] | None:
        """Grant the head of the line, or `item` if given: the waiter, what its client was
        charged, and whether that may have moved another waiter back. Granting the head moves
        V to its start; a waiter granted out of turn (those ahead cannot use the free slot)
        leaves V, since those ahead were not served, and may move its client's later waiters
        back. None if nobody waits."""
        head = self._best_head(now)
        if head is None:
            return None
        waiter = head[0] if item is None else self._waiters[item]
        in_turn = waiter is head[0]
        state, _ = self._unqueue(waiter)  # a new head goes on a heap with the new charge
        grant = self._charge(state, waiter.rank, waiter.arrived, in_turn)
        self._forget_if_idle(state)
        return waiter.item, grant, not in_turn and self._busy > 1

    def admit(self, client: str, rank: int, now: float) -> tuple[Grant, bool]:
        """A request that found a free slot: it skips the line but its service still counts,
        as a grant in turn. Also whether that may move a waiter back: only its client's own,
        and only past another client's."""
        state = self._client(client)
        grant = self._charge(state, rank, self._at(now), in_turn=True)
        return grant, state.waiting > 0 and self._busy > 1

    def _charge(self, state: _Client, rank: int, arrived: float, in_turn: bool) -> Grant:
        """Charge `state` its expected slot time for one grant: the fair share's one charge."""
        start = max(self._virtual, state.finish)
        if in_turn:
            self._virtual = start
        state.finish = start + state.estimate / state.weight
        for queue in state.queues.values():
            self._push(queue)
        rank = served_as(rank, arrived, self._now, self.aging)
        return Grant(state.name, rank, state.estimate)

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
        for queue in state.queues.values():
            self._push(queue)
        return self._busy > 1

    def arrived(self, item: T) -> tuple[str, int, float]:
        """A waiter's client, class and arrival, to move it to another line (a reload that
        joins two lines) without losing its place in time."""
        waiter = self._waiters[item]
        return waiter.client, waiter.rank, waiter.arrived

    def head(self, now: float) -> T | None:
        """The waiter `grant` would serve now, left in the line; None if nobody waits."""
        queue = self._best_head(now)
        return None if queue is None else queue[0].item

    def _at(self, now: float) -> float:
        """`now`, or the latest moment seen if that is later: time inside the line never goes
        back, so the heads' classes (`_age`) only ever move to better ones."""
        if now > self._now:
            self._now = now
            self._age()
        return self._now

    def _unqueue(self, waiter: Waiter[T]) -> tuple[_Client, _Fifo | None]:
        """Take a waiter out of the line, wherever it stands (O(its client's queue)): its
        client, and its FIFO if that has a new head, which the caller pushes."""
        del self._waiters[waiter.item]
        state = self._clients[waiter.client]
        queue = state.queues[waiter.rank]
        headed = None
        if queue[0] is waiter:
            queue.popleft()
            if queue:
                head = queue[0]
                queue.rank = served_as(head.rank, head.arrived, self._now, self.aging)
                headed = queue
        else:
            queue.remove(waiter)
        state.waiting -= 1
        if not state.waiting:
            self._busy -= 1
        elif state.waiting == 1:
            self._crowded -= 1
        if not self._waiters:
            self._highest = None
        if not queue:
            queue.stamp = 0  # its entry on a heap of heads is stale
            del state.queues[waiter.rank]
            self._queues -= 1
            self._tidy()
        if len(self._ages) > 2 * len(self._waiters) + 64:
            self._ages = [entry for entry in self._ages if self._live(entry[2])]
            heapq.heapify(self._ages)
        return state, headed

    def _forget_if_idle(self, state: _Client) -> None:
        """Idle and owing nothing, a client would start at V anyway: forgotten, which keeps
        the table small when clients are peer addresses."""
        if not state.waiting and state.finish <= self._virtual:
            del self._clients[state.name]

    def _live(self, waiter: Waiter[T]) -> bool:
        return self._waiters.get(waiter.item) is waiter

    def _new_head(self, queue: _Fifo) -> None:
        """`queue` has a new head: its class now, and its entry."""
        head = queue[0]
        queue.rank = served_as(head.rank, head.arrived, self._now, self.aging)
        self._push(queue)

    def _push(self, queue: _Fifo) -> None:
        """Put `queue`'s head on the heap its client's finish puts it on, under a new stamp
        (its older entry goes stale): its head, class or client's finish changed."""
        self._stamps += 1
        stamp = queue.stamp = self._stamps
        state = queue.client
        if state.finish <= self._virtual:
            self._push_at_v(queue, stamp)
        else:
            at = place(queue.rank, state.finish, queue[0], state, queue)
            heapq.heappush(self._owing, (at, stamp, queue))
        self._tidy()

    def _push_at_v(self, queue: _Fifo, stamp: int) -> None:
        entry = (place(queue.rank, AT_V, queue[0], queue.client, queue), stamp, queue)
        if self._highest is None or entry[0] > self._highest[0]:
            self._highest = entry
        heapq.heappush(self._at_v, entry)

    def _tidy(self) -> None:
        """Drop the stale entries of the heaps of heads once they outnumber the live ones (and
        64): the heaps stay O(q) for q FIFOs."""
        if len(self._at_v) + len(self._owing) > 2 * self._queues + 64:
            self._at_v = [entry for entry in self._at_v if entry[1] == entry[2].stamp]
            self._owing = [entry for entry in self._owing if entry[1] == entry[2].stamp]
            heapq.heapify(self._at_v)
            heapq.heapify(self._owing)

    def _will_age(self, waiter: Waiter[T]) -> None:
        """Note the next moment `waiter` is served as a better class, if it can still age."""
        if self.aging is None:
            return
        rank = served_as(waiter.rank, waiter.arrived, self._now, self.aging)
        if rank:
            moment = aged_at(waiter.arrived, waiter.rank - rank + 1, self.aging)
            self._stamps += 1
            heapq.heappush(self._ages, (moment, self._stamps, waiter))

    def _age(self) -> None:
        """Move the heads whose aging moment came by `_now` to their better class."""
        ages = self._ages
        while ages and ages[0][0] <= self._now:
            waiter = heapq.heappop(ages)[2]
            if not self._live(waiter):
                continue
            self._will_age(waiter)
            queue = self._clients[waiter.client].queues[waiter.rank]
            if queue[0] is waiter:
                self._new_head(queue)

    def _best_head(self, now: float) -> _Fifo | None:
        """The FIFO whose head goes first at `now`."""
        self._at(now)
        return self._least()

    def _least(self) -> _Fifo | None:
        """The FIFO of the least head on the heaps, once stale entries and heads whose client
        V caught up with are out of the way."""
        virtual = self._virtual
        at_v, owing = self._at_v, self._owing
        while owing:
            _, stamp, queue = owing[0]
            if stamp != queue.stamp:
                heapq.heappop(owing)
            elif queue.client.finish <= virtual:  # its client starts at V now
                heapq.heappop(owing)
                self._push_at_v(queue, stamp)
            else:
                break
        while at_v and at_v[0][1] != at_v[0][2].stamp:
            heapq.heappop(at_v)
        if not at_v:
            return owing[0][2] if owing else None
        queue = at_v[0][2]
        if owing and place(queue.rank, virtual, queue[0], queue.client, queue) > owing[0][0]:
            return owing[0][2]
        return queue

    def is_last(self, item: T, now: float) -> bool:
        """Whether `order(now)` ends with the newcomer `item`, answered without a walk of the
        order, False when unsure: a newcomer that goes last moves nobody, and its place is the
        line's length (`python -m bench.burst --distinct`: 5,000 clients waiting once each
        would otherwise walk the order once each).

        The case: no client waits twice (every waiter is a head), nobody waiting owes slot
        time (every start is V, and serving them keeps V), and `item`'s place is the highest
        on `_at_v`: everyone else goes before it."""
        if self._crowded:
            return False
        self._at(now)
        self._least()  # drops the stale and the caught-up from `_owing`
        if self._owing:
            return False
        highest = self._highest
        if highest is not None and highest[1] != highest[2].stamp:  # its head moved or left
            highest = self._highest = max(
                (entry for entry in self._at_v if entry[1] == entry[2].stamp), default=None
            )
        waiter = self._waiters[item]
        state = self._clients[waiter.client]
        queue = state.queues[waiter.rank]
        return highest is not None and place(queue.rank, AT_V, waiter, state, queue) == highest[0]

    def order(self, now: float) -> Iterator[T]:
        """Everyone waiting, in the order they would be served if nothing else arrived and no
        estimate changed: the position of a waiter is its index here plus one. Lazy: the first
        k cost O(k log k), for a walk that stops after a few (`python -m bench.claims`: a
        shared line's claims at 5,000 distinct clients). The line must not change meanwhile."""
        self._at(now)
        head = self._least()
        if head is None:
            return iter(())
        if self._queues == 1:
            return map(_item, head)
        return self._replay(self._now)

    def _replay(self, now: float) -> Iterator[T]:
        """Replay `grant` on the heaps without changing them: a frontier heap holds their
        entries reached so far, each under a lower bound of its place (V and the finishes only
        grow): a live head of `_at_v` its place at the replay's V, any other entry the place it
        was pushed with. Children enter when their parent leaves, so each heap's order is kept.
        An entry whose place grew goes back under its true place; the FIFOs the replay took
        from, and the clients it charged, are kept aside (`taken`, `finish`)."""
        virtual, aging = self._virtual, self.aging
        at_v, owing = self._at_v, self._owing
        finish: dict[int, float] = {}  # id of a client charged in the replay -> its finish
        taken: dict[int, int] = {}  # id of a FIFO the replay took from -> how many
        tick = 0  # a unique second key, so that entries never compare their FIFOs
        # (place, tick, source, where): source 0 and 1 are `_at_v` and `_owing` at index
        # `where`, 2 a FIFO (`where`) the replay moved on.
        frontier: list[tuple[Place, int, int, object]] = []

        def reach(source: int, index: int) -> None:
            nonlocal tick
            heap = owing if source else at_v
            if index >= len(heap):
                return
            bound, stamp, queue = heap[index]
            if not source and stamp == queue.stamp:
                bound = place(queue.rank, virtual, queue[0], queue.client, queue)
            tick += 1
            heapq.heappush(frontier, (bound, tick, source, index))

        def start_of(state: _Client) -> float:
            return max(virtual, finish.get(id(state), state.finish))

        def placed(queue: _Fifo, at: int, start: float) -> Place:
            waiter = queue[at]
            rank = served_as(waiter.rank, waiter.arrived, now, aging)
            return place(rank, start, waiter, queue.client, queue)

        reach(0, 0)
        reach(1, 0)
        while frontier:
            top = frontier[0]
            source, where = top[2], top[3]
            if source == 2:  # a FIFO the replay moved on
                queue = where  # type: ignore[assignment]
                at = taken[id(queue)]
                start = start_of(queue.client)
                key = placed(queue, at, start)
                if key != top[0]:  # its client was charged meanwhile: back under its place
                    tick += 1
                    heapq.heapreplace(frontier, (key, tick, 2, queue))
                    continue
            else:
                heapq.heappop(frontier)
                reach(source, 2 * where + 1)  # type: ignore[operator]
                reach(source, 2 * where + 2)  # type: ignore[operator]
                _, stamp, queue = (owing if source else at_v)[where]  # type: ignore[index]
                at = 0
                if stamp != queue.stamp or id(queue) in taken:  # stale, or replayed aside
                    continue
                start = start_of(queue.client)
                key = placed(queue, at, start)
                if key > top[0]:  # its bound was low: back under its true place
                    tick += 1
                    heapq.heappush(frontier, (key, tick, 2, queue))
                    taken[id(queue)] = 0
                    continue
            yield queue[at].item
            state = queue.client
            virtual = start
            finish[id(state)] = start + state.estimate / state.weight
            taken[id(queue)] = at + 1
            if at + 1 < len(queue):  # its next waiter takes its place (still the top, if 2)
                tick += 1
                entry = (placed(queue, at + 1, start_of(state)), tick, 2, queue)
                if source == 2:
                    heapq.heapreplace(frontier, entry)
                else:
                    heapq.heappush(frontier, entry)
            elif source == 2:
                heapq.heappop(frontier)

    def next_aging(self, now: float) -> float | None:
        """The first moment after `now` at which some waiter is served as a better class, if
        that can change the order (more than one queue waits): until then time moves nobody."""
        if self.aging is None or self._queues < 2:
            return None
        self._at(now)
        ages = self._ages
        while ages and not self._live(ages[0][2]):
            heapq.heappop(ages)
        return ages[0][0] if ages else None

    def waiting_by_class(self, now: float) -> dict[str, int]:
        """Waiters per class they would be served as now (aging included)."""
        now = self._at(now)
        counts = dict.fromkeys(CLASSES, 0)
        for waiter in self._waiters.values():
            counts[CLASSES[served_as(waiter.rank, waiter.arrived, now, self.aging)]] += 1
        return counts

    def oldest_arrival(self) -> float | None:
        """When the longest-waiting waiter joined: waiters are kept in joining order."""
        first = next(iter(self._waiters.values()), None)
        return None if first is None else first.arrived

    def waiting_by_client(self) -> dict[str, int]:
        return {name: state.waiting for name, state in self._clients.items() if state.waiting}
