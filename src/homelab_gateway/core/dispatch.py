"""Who gets a free slot, and on which replica (sans-IO).

`Dispatch` holds one line's waiters: the fair `line.Line`, the retries served before it, and
what each waiter may take (`Want`). It decides grants on plain values: `next` picks the first
waiter, in order, that may start on a replica now, takes it out and starts it there. A client
that holds its `max_in_flight` (`caps`) slots of the line is *capped*: its waiters keep their
place in the fair order but are passed over, so they count as behind everyone else. Both
lines drive it: the in-process semaphore at once, the line shared through Redis as it replays
the stream's events (where Redis, not this object, decides who is granted: `grant` applies
that). Nothing here holds a timer or a Deferred.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Generic, TypeVar

from homelab_gateway.core.line import Grant, Line, served_as
from homelab_gateway.core.replicas import DOWN, UP, Circuit, Sessions, choose

T = TypeVar("T", bound=Hashable)
NOBODY: frozenset[str] = frozenset()


@dataclass(eq=False)
class Replica:
    """One upstream's slots, and its health. It belongs to one line at a time (`line`); a
    reload may move it to another, with the slots it holds."""

    name: str
    limit: int
    fallback: bool = False
    circuit: Circuit = field(default_factory=Circuit)
    held: int = 0
    line: Any = None  # the semaphore whose line it is in
    owner: Any = None  # what the service keeps for this upstream (its Pool)
    share: float | None = None  # while set, only this fraction of `limit` may be held
    # Of `held`, by client: kept here, so a reload that moves the replica moves the count.
    clients: dict[str, int] = field(default_factory=dict)
    # False while a model loaded on demand is not loaded, or is held for a swap: no grants.
    resident: bool = True

    @property
    def usable(self) -> int:
        """The slots that may be held: all of them, none while its model is not resident, or a
        gateway's fallback share of a shared upstream while it cannot reach the others."""
        if not self.resident:
            return 0
        return self.limit if self.share is None else int(self.limit * self.share)

    @property
    def free(self) -> int:
        return max(0, self.usable - self.held)

    def open_at(self, now: float) -> bool:
        """Whether a request may start here now: a free slot, and in rotation."""
        return self.held < self.usable and self.circuit.admits(now)


@dataclass(slots=True, frozen=True)
class Want:
    """What a waiter may take: slots of `among` (None: any replica of the line), preferably not
    of `avoid` (replicas it already failed on), preferably where `session` was served last."""

    among: frozenset[Replica] | None = None
    avoid: frozenset[Replica] = frozenset()
    session: str | None = None

    @property
    def restricted(self) -> bool:
        """Whether a free slot may go to a waiter behind the head of the line."""
        return self.among is not None or bool(self.avoid)


@dataclass(slots=True)
class Start(Generic[T]):
    """A waiter (or a newcomer: `item` None) that starts on `replica` now."""

    item: T | None
    want: Want | None
    replica: Replica
    grant: Grant
    trial: bool  # the one request a half-open replica lets through
    moved: bool  # whether granting it may have moved another waiter back


class Dispatch(Generic[T]):
    """One line's waiters and the decision of who starts where."""

    def __init__(
        self,
        members: Sequence[Replica],
        *,
        aging: float | None = None,
        weights: Mapping[str, float] = {},
        caps: Mapping[str, int] = {},
    ) -> None:
        self.members = list(members)
        self.line: Line[T] = Line(aging=aging, weights=weights)
        self.sessions = Sessions()
        self.caps = dict(caps)  # client -> max_in_flight
        self._retries: dict[T, tuple[str, int, float]] = {}  # served before the line, in order
        self._wants: dict[T, Want] = {}
        self._restricted = 0  # waiters in `line` that cannot take every replica's slot
        self._turn = 0

    def __len__(self) -> int:
        return len(self.line) + len(self._retries)

    def __contains__(self, item: object) -> bool:
        return item in self._retries or item in self.line

    def configure(self, caps: Mapping[str, int]) -> None:
        """New `max_in_flight`s (config reload): a lower one takes effect as slots are
        released, never by revoking one."""
        self.caps = dict(caps)

    def held_by(self, client: str) -> int:
        """The slots of the line `client`'s requests hold."""
        return sum(m.clients.get(client, 0) for m in self.members)

    @property
    def in_flight(self) -> dict[str, int]:
        """The slots of the line held, by client."""
        totals: dict[str, int] = {}
        for member in self.members:
            for client, held in member.clients.items():
                totals[client] = totals.get(client, 0) + held
        return totals

    def capped(self, client: str, pending: int = 0) -> bool:
        """Whether `client` may take no further slot (with `pending` more on their way)."""
        cap = self.caps.get(client)
        return cap is not None and self.held_by(client) + pending >= cap

    def capped_clients(self) -> frozenset[str]:
        """The clients that hold their max_in_flight: a look at each cap, none configured."""
        if not self.caps:
            return NOBODY
        return frozenset(c for c, cap in self.caps.items() if self.held_by(c) >= cap)

    def hold(self, replica: Replica, client: str) -> bool:
        """`client`'s request holds a slot of `replica`. True if that capped the client while
        it has waiters: they go back behind everyone else."""
        replica.held += 1
        replica.clients[client] = replica.clients.get(client, 0) + 1
        return self.capped(client) and self._waits(client)

    def unhold(self, replica: Replica, client: str) -> bool:
        """`client`'s request gave back its slot of `replica`. True if that uncapped the
        client while it has waiters: one of them may start now."""
        replica.held -= 1
        held = replica.clients.get(client, 0) - 1
        if held > 0:
            replica.clients[client] = held
        else:
            replica.clients.pop(client, None)
        cap = self.caps.get(client)
        return cap is not None and self.held_by(client) == cap - 1 and self._waits(client)

    def client_of(self, item: T) -> str:
        retry = self._retries.get(item)
        return retry[0] if retry is not None else self.line.arrived(item)[0]

    def _waits(self, client: str) -> bool:
        return bool(self.line.waiting_for(client)) or any(
            r[0] == client for r in self._retries.values()
        )

    def _capped_waiting(self, capped: frozenset[str]) -> bool:
        """Whether one of the `capped` clients has waiters: then the order is not the fair
        line's alone."""
        return any(self._waits(c) for c in capped)

    @property
    def plain(self) -> bool:
        """Whether the order is one FIFO (one client, one class, no retry): a newcomer's place
        is the line's length, and nothing but a grant or a leave moves anyone."""
        return self.line.queues <= 1 and not self._retries

    def want(
        self, among: frozenset[Replica] | None, avoid: frozenset[Replica], session: str | None
    ) -> Want | None:
        """What a waiter may take; None for any replica of the line, no session."""
        if among is not None and len(among) == len(self.members):
            among = None
        return Want(among, avoid, session) if among is not None or avoid or session else None

    def want_of(self, item: T) -> Want | None:
        return self._wants.get(item)

    def open_for(self, want: Want | None, now: float) -> list[Replica]:
        """The replicas a waiter may start on now. A retry avoids the replicas it failed on
        while another of its replicas is in rotation (busy or not)."""
        members = self.members
        if want is not None:
            if want.among is not None:
                members = [m for m in members if m in want.among]
            if want.avoid:
                fresh = [m for m in members if m not in want.avoid and m.circuit.state != DOWN]
                members = fresh or members
        return [m for m in members if m.open_at(now)]

    def ranked(self, candidates: list[Replica], session: str | None) -> list[Replica]:
        """`candidates` best first: the one `replicas.choose` takes, then the most free."""
        if not candidates:
            return []
        best = choose(candidates, self.sessions.get(session), self._turn)
        self._turn += 1
        return [best, *sorted((m for m in candidates if m is not best), key=lambda m: -m.free)]

    def started(self, replica: Replica, session: str | None, client: str) -> tuple[bool, bool]:
        """`client`'s request starts on `replica`: its slot is held, its session served there.
        Whether it is the trial of a half-open replica, and whether it capped its client
        (`hold`)."""
        capped = self.hold(replica, client)
        self.sessions.served(session, replica.name)
        return replica.circuit.begin(), capped

    def admit(self, client: str, rank: int, want: Want | None, now: float) -> Start[T] | None:
        """A newcomer that may start now on a replica it may take: it skips the line, and its
        service still counts. None if none is open to it, or its client is capped: it must
        wait."""
        if self.capped(client):
            return None
        candidates = self.open_for(want, now)
        if not candidates:
            return None
        grant, moved = self.line.admit(client, rank, now)
        return self._start(None, want, candidates, grant, moved)

    def _start(
        self,
        item: T | None,
        want: Want | None,
        candidates: list[Replica],
        grant: Grant,
        moved: bool,
    ) -> Start[T]:
        session = want.session if want is not None else None
        replica = choose(candidates, self.sessions.get(session), self._turn)
        self._turn += 1
        trial, capped = self.started(replica, session, grant.client)
        return Start(item, want, replica, grant, trial, moved or capped)

    def join(
        self, item: T, client: str, rank: int, arrived: float, want: Want | None, retry: bool
    ) -> bool:
        """`item` waits: in the line, or (a retry: it had reached the head once) ahead of it.
        False if it went ahead of its client's waiters of its class (`Line.join`)."""
        last = True
        if retry:
            self._retries[item] = (client, rank, arrived)
        else:
            last = self.line.join(item, client, rank, arrived)
            if want is not None and want.restricted:
                self._restricted += 1
        if want is not None:
            self._wants[item] = want
        return last

    def leave(self, item: T) -> bool:
        """A waiter that gave up leaves; True if that may have moved another waiter back."""
        moved = False
        if self._retries.pop(item, None) is None:
            moved = self.line.leave(item)
            self._unrestrict(item)
        self._wants.pop(item, None)
        return moved

    def _unrestrict(self, item: T) -> None:
        want = self._wants.get(item)
        if want is not None and want.restricted:
            self._restricted -= 1

    def next(self, now: float) -> Start[T] | None:
        """Take out the first waiter, in order, that may start on a replica now, and start it
        there; None if nobody waiting may."""
        if not any(m.open_at(now) for m in self.members):
            return None
        capped = self.capped_clients()
        for item, (client, _, _) in self._retries.items():
            if client in capped:
                continue
            want = self._wants.get(item)
            candidates = self.open_for(want, now)
            if candidates:
                return self._start(item, want, candidates, *self.grant(item, now))
        if not self._restricted and not self._capped_waiting(capped):
            # Everyone may take any replica, so the head of the line gets it.
            granted = self.line.grant(now)
            if granted is None:
                return None
            item, grant, moved = granted
            want = self._wants.pop(item, None)
            return self._start(item, want, self.open_for(want, now), grant, moved)
        for item in self.line.order(now):
            if capped and self.line.arrived(item)[0] in capped:
                continue
            want = self._wants.get(item)
            candidates = self.open_for(want, now)
            if candidates:
                return self._start(item, want, candidates, *self.grant(item, now))
        return None

    def first(self, now: float) -> tuple[int, float] | None:
        """The first waiter's class as served now (aging included) and its arrival: what the
        lines of the models on one box are compared by (`core.residency`)."""
        for _, rank, arrived in self._retries.values():
            return served_as(rank, arrived, now, self.line.aging), arrived
        item = self.line.head(now)
        if item is None:
            return None
        _, rank, arrived = self.line.arrived(item)
        return served_as(rank, arrived, now, self.line.aging), arrived

    def grant(self, item: T, now: float) -> tuple[Grant, bool]:
        """Take waiter `item` out, granted, and charge its client as the line does (a retry as
        admitted). Also whether that may have moved another waiter back."""
        retry = self._retries.pop(item, None)
        if retry is not None:
            client, rank, _ = retry
            grant, moved = self.line.admit(client, rank, now)
        else:
            self._unrestrict(item)
            granted = self.line.grant(now, item)
            assert granted is not None
            grant, moved = granted[1], granted[2]
        self._wants.pop(item, None)
        return grant, moved

    def order(self, now: float) -> Iterator[T]:
        """Everyone waiting, in the order they would be served: retries, then the line; the
        waiters of capped clients after all others, in that same order."""
        line = self.line.order(now)
        order = chain(self._retries, line) if self._retries else line
        capped = self.capped_clients()
        return self._capped_last(order, capped) if self._capped_waiting(capped) else order

    def _capped_last(self, order: Iterator[T], capped: frozenset[str]) -> Iterator[T]:
        later = []
        for item in order:
            if self.client_of(item) in capped:
                later.append(item)
            else:
                yield item
        yield from later

    def is_last(self, item: T, now: float) -> bool:
        """Whether the newcomer `item` is last in `order` (False when unsure)."""
        if item not in self.line:
            return False
        capped = self.capped_clients()
        if self._capped_waiting(capped) and self.line.arrived(item)[0] not in capped:
            return False
        return self.line.is_last(item, now)

    def arrival(self, item: T) -> tuple[str, int, float, bool]:
        """A waiter's client, class, arrival and whether it is a retry: to move it to another
        line without losing its place."""
        retry = self._retries.get(item)
        if retry is not None:
            return (*retry, True)
        return (*self.line.arrived(item), False)

    def want_here(self, want: Want | None) -> tuple[bool, Want | None]:
        """Whether a waiter of another line (a reload) may wait in this one, and what it may
        take here: one that could take any of the old line's replicas (its model's) takes any
        of this line's; one kept to some keeps to those of them that are here."""
        want = want or Want()
        among = frozenset(self.members) if want.among is None else want.among
        among = among.intersection(self.members)
        restricted = among if len(among) < len(self.members) else None
        moved = Want(restricted, want.avoid, want.session)
        return bool(among), (moved if moved != Want() else None)

    def slots(self) -> tuple[int, int]:
        """All the slots, and those free in rotation."""
        limit = max(1, sum(m.limit for m in self.members))
        return limit, sum(m.free for m in self.members if m.circuit.state == UP)
