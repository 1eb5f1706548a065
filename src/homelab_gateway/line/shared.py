"""A line shared by several gateways through Redis: the same line, another source of changes.

A shared line is a `limiter.PositionedSemaphore` whose source is a `RedisSource`: its state
(the `dispatch.Dispatch`, the replicas' held slots and health) is a copy, changed only by
replaying the events that the Lua scripts (`scripts`) append to one Redis stream, in the
stream's order and at the time Redis stamped on each, so every gateway's copy is the same
line. Each event is applied with the same calls the in-process source makes. A waiter of
another gateway is a `Remote` in the copy: it counts in every position, it is never told one.

A request joins with one script call (`join`: a free slot at once if nobody waits); a free
slot is then claimed (`grant`) for the waiter that this gateway's copy puts first, by every
gateway that sees it free: Redis takes the first claim and refuses the rest, so the cap holds
whoever claims, and a waiter whose gateway is slow or dead is still served in its turn. A
slot given back (`release`), a waiter that gives up (`leave`), a replica's verdict or probe
(`note`) are events like the others.

While Redis cannot be reached (`lost`) nothing can be granted without risking the cap. For
`outage_grace` seconds the copy is kept as it was: every waiter keeps its place (and is told
it), new requests join behind them, requests holding a slot run to their end and their
releases are sent when Redis is back. Then `rebuild` makes the copy anew from a snapshot, and
this gateway's waiters that Redis does not have (it lost its data, or their join never ran)
join again with their first arrival, so the order survives; a running slot Redis no longer
knows is counted again. Past the grace (`outage_over`) this gateway's waiters get 529, and new
requests at once. With a `fallback_share`, the line's changes are the in-process source's
meanwhile, for that share of each upstream's slots, for as long as the outage lasts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from homelab_gateway.core.dispatch import Replica
from homelab_gateway.core.line import Grant
from homelab_gateway.core.replicas import UP
from homelab_gateway.line import wire
from homelab_gateway.line.cluster import LINK_FAILURES, Cluster, SharedClock
from homelab_gateway.line.limiter import InProcess, PositionedSemaphore, Request, Slot
from homelab_gateway.line.refusals import Unavailable

log = Logger()
CLAIM_RETRY = 0.2
"""After a refused claim (another gateway's claim won, or this copy was a step behind), look
again this much later at the latest: the event that explains the refusal usually comes first."""


def _ignore(failure: Failure) -> None:
    """A script call whose failure changes nothing here: a lost link is seen by the reader,
    and the line is rebuilt from Redis when it is back."""


class Remote:
    """A waiter of another gateway, in this gateway's copy of the line."""

    __slots__ = ("id",)

    def __init__(self, id: str) -> None:
        self.id = id

    def __repr__(self) -> str:
        return f"Remote({self.id!r})"


def shared_line(
    tokens: Sequence[Replica], reactor: Any, *, cluster: Cluster, **settings: Any
) -> PositionedSemaphore:
    """The slots of `tokens` and their line, shared with every gateway of `cluster`."""
    clock = SharedClock(reactor)
    line = PositionedSemaphore(tokens, clock, **settings)
    line.source = RedisSource(line, clock, cluster)
    return line


class RedisSource:
    """A shared line's changes: asked of Redis, applied as its stream replays them."""

    def __init__(self, line: PositionedSemaphore, clock: SharedClock, cluster: Cluster) -> None:
        self.line = line
        self.clock = clock
        self.reactor = clock.reactor
        self.cluster = cluster
        self.fallback = InProcess(line, on_start=self._fallback_slot)
        self.member_names = sorted(m.name for m in line.members)
        self.key = "+".join(self.member_names)  # the same on every gateway, whatever the order
        self._local: dict[str, Deferred[Slot]] = {}  # this gateway's waiters, until granted
        self._requests: dict[str, Request] = {}
        self._cancelled: set[str] = set()  # this gateway's, given up: their leave is on its way
        self._items: dict[str, Any] = {}  # every waiter in the copy, by id
        self._ids: dict[Any, str] = {}  # and back (this gateway's from their acquire on)
        self._slots: dict[str, Slot] = {}  # every slot taken, by id
        self._mine: dict[str, Slot] = {}  # those this gateway's requests hold
        self._claiming: set[str] = set()
        self._look_again: IDelayedCall | None = None
        self._replaying = False
        self.since = 0  # the number of the last event its copy was rebuilt with
        self.retired = False  # a reload regrouped its upstreams: another line took its place
        cluster.add(self)

    def _ours(self, w: str) -> bool:
        return w.startswith(self.cluster.instance + "/")

    def _member(self, name: str) -> Replica | None:
        return next((m for m in self.line.members if m.name == name), None)

    def refresh(self) -> None:
        self.line.refresh()
        self._drop_if_done()

    def serves(self, members: Sequence[Replica]) -> bool:
        """Whether its key names `members`: a line's key is always the upstreams it serves."""
        return sorted(m.name for m in members) == self.member_names

    def _drop_if_done(self) -> None:
        """A retired line is dropped once nothing runs or waits through it, as this copy
        sees it up to date: no waiter, no slot, no release still to send. One that a newer
        line of its key replaced in the cluster gets no events: only its own count."""
        if not self.retired or not self.cluster.live or self._local:
            return
        if self.cluster.lines.get(self.key) is self:
            if self._slots or self.line.waiting:
                return
        elif self._mine:
            return
        if any(key == self.key for key, _ in self.cluster.unsent):
            return
        self.cluster.remove(self)
        self.line.close()

    def runs(self, w: str) -> bool:
        """Whether a request of this gateway holds slot `w` through this line."""
        return w in self._mine

    # -- this gateway's requests ---------------------------------------------------------------

    def ask(self, request: Request) -> Deferred[Slot]:
        """The slot or the place comes back from Redis. Raises Unavailable while Redis cannot
        be reached and there is no fallback share."""
        if not self.cluster.live:
            if not (self.cluster.config.fallback_share or self.cluster.in_grace):
                raise Unavailable(f"the shared line is unreachable: {self.cluster.last_error}")
            return self.fallback.ask(request)  # waits: nothing is granted but the share
        if not request.retry:
            self.line.refuse_if_full(request.client)
        return self._ask(request)

    def _ask(
        self, request: Request, arrived: float | None = None, d: Deferred[Slot] | None = None
    ) -> Deferred[Slot]:
        """Join the shared line with `request` (under a new id); `arrived` and `d` for a
        waiter that moves here from another line or the fallback share, with its place."""
        if d is None:
            d = self.line.new_waiter(request)
        dispatch, want = self.line.dispatch, request.want
        open_now = dispatch.open_for(want, self.clock.seconds())
        ranked = dispatch.ranked(open_now, want.session if want else None)
        # Every argument is made before anything is kept for the waiter: a failure here
        # leaves nothing behind.
        w = self.cluster.new_id()
        client = request.client
        arrival = "" if arrived is None else repr(arrived)
        args = (w, wire.info(request), arrival, wire.preferences(ranked), self._cap(client))
        self._local[w] = d
        self._ids[d] = w
        self._requests[w] = request
        self.cluster.line_call(self, "join", *args).addErrback(self._not_asked, w)
        return d

    def _not_asked(self, failure: Failure, w: str) -> None:
        """The join's reply never came: Redis may have run it (its event may even be replayed
        already) or not. A lost link keeps it in the copy, to be found in Redis or to join
        again when the link is back (`rebuild`); any other failure makes it leave, as one that
        gives up does, and hear why."""
        d = self._local.get(w)
        if failure.check(Unavailable, *LINK_FAILURES) and d is not None and not d.called:
            self.cluster.drop(failure.getErrorMessage())  # the copy cannot know; rebuild it
            if d not in self.line.dispatch:
                now = self.clock.seconds()
                self.line.wait(d, self._requests[w], now, now)
            return
        self._give_up(w)
        if d is not None and not d.called:
            reason = failure.getErrorMessage()
            d.errback(Unavailable(f"the shared line is unreachable: {reason}"))

    def give_up(self, d: Deferred[Slot]) -> None:
        w = self._ids.get(d)
        if d in self.line.dispatch and not self.cluster.live:  # waiting out an outage
            self.fallback.give_up(d)
            if w is None or self._local.get(w) is not d:
                return
        if w is not None:
            self._give_up(w)

    def _give_up(self, w: str) -> None:
        """This gateway's waiter `w` leaves; the copy drops it when the leave comes back (a
        slot granted meanwhile is given back at once)."""
        d = self._local.pop(w, None)
        self._cancelled.add(w)
        self._requests.pop(w, None)
        if d is not None and self._items.get(w) is not d:
            self._ids.pop(d, None)
        self.cluster.line_call(self, "leave", w).addCallbacks(self._left, _ignore, (w,))

    def _left(self, result: object, w: str) -> None:
        """Redis never had `w` (its join did not run): no leave event will forget it."""
        if result == "unknown":
            self._cancelled.discard(w)

    def release(self, slot: Slot) -> None:
        self._mine.pop(slot.id, None)
        args = (slot.replica.name, "1" if slot.trial and not slot.judged else "")
        if not self.cluster.live:  # the copy is this gateway's own until Redis is back
            self.cluster.unsent[(self.key, slot.id)] = args
            self._slots.pop(slot.id, None)
            self.fallback.release(slot)
            return
        if slot.on_release is not None:
            # Redis's clock, as this copy last set it: a quick release may come out below 0.
            slot.on_release(max(0.0, self.clock.seconds() - slot.granted_at))

        def unsent(failure: Failure) -> None:
            self.cluster.unsent[(self.key, slot.id)] = args

        self.cluster.line_call(self, "release", slot.id, *args).addErrback(unsent)
        self._drop_if_done()

    def judge(self, slot: Slot, failure: str | None) -> None:
        circuit = slot.replica.circuit
        if failure is None and circuit.state == UP and not circuit.failures:
            return  # nothing for anyone to change
        if not self.cluster.live:
            self.fallback.judge(slot, failure)
            return
        event: dict[str, Any] = {"op": "verdict", "r": slot.replica.name}
        if failure is not None:
            event["why"] = failure
        self.cluster.line_call(self, "note", orjson.dumps(event)).addErrback(_ignore)

    def probed(self, replica: Replica) -> None:
        if replica.circuit.state == UP:
            return
        if not self.cluster.live:
            self.fallback.probed(replica)
            return
        event = orjson.dumps({"op": "probed", "r": replica.name})
        self.cluster.line_call(self, "note", event).addErrback(_ignore)

    def fail_waiting(self, reason: Exception) -> None:
        """This gateway's waiters fail with `reason` (shutdown) and leave the shared line."""
        if not self.cluster.live:  # those waiting out an outage wait in the copy
            self._fail_here(reason)
        for w, d in list(self._local.items()):
            self._give_up(w)
            if not d.called:
                d.errback(reason)

    # -- claims --------------------------------------------------------------------------------

    def grant_free(self) -> bool:
        """Slots are granted by Redis: claim what this copy shows free (after a batch of
        events, not in its middle). Never moves anyone itself. Cut off from Redis, the
        fallback share is granted here, as in process; never in a batch being replayed, whose
        copy may hold other gateways' waiters while the link is going down."""
        if self._replaying:
            return False
        if not self.cluster.live:
            return self.fallback.grant_free()
        self._claim()
        return False

    def _fallback_slot(self, slot: Slot) -> None:
        """A slot of the fallback share: it gets an id, to be counted in Redis when it is
        back (`rebuild`)."""
        slot.id = self.cluster.new_id()
        self._mine[slot.id] = slot
        self._slots[slot.id] = slot

    def _cap(self, client: str) -> str:
        """`client`'s max_in_flight, as a script reads it: '' for none."""
        cap = self.line.dispatch.caps.get(client)
        return "" if cap is None else str(cap)

    def _pending(self) -> dict[str, int]:
        """Claims on their way, by client: a capped client's next waiter is not claimed for."""
        dispatch, pending = self.line.dispatch, {}
        if dispatch.caps:
            for w in self._claiming:
                item = self._items.get(w)
                if item is not None and item in dispatch:
                    client = dispatch.client_of(item)
                    pending[client] = pending.get(client, 0) + 1
        return pending

    def _claim(self) -> None:
        line = self.line
        if not self.cluster.live or not line.waiting:
            return
        now = self.clock.seconds()
        budget = {m: m.free for m in line.members if m.open_at(now)}
        spare = sum(budget.values()) - len(self._claiming)
        if spare <= 0:
            return
        dispatch = line.dispatch
        pending = self._pending()
        capped = dispatch.capped_clients()
        # A claim is for the first waiters not yet claimed for: the walk stops after a few,
        # or at the first capped client's, behind whom all are capped.
        for item in dispatch.order(now):
            w = self._ids[item]
            if w in self._claiming:
                continue
            client = dispatch.client_of(item)
            if client in capped:
                return
            if dispatch.capped(client, pending.get(client, 0)):
                continue
            want = dispatch.want_of(item)
            candidates = [m for m in dispatch.open_for(want, now) if budget[m] > 0]
            if not candidates:
                continue
            ranked = dispatch.ranked(candidates, want.session if want else None)
            budget[ranked[0]] -= 1
            spare -= 1
            pending[client] = pending.get(client, 0) + 1
            self._claiming.add(w)
            prefs = wire.preferences(ranked)
            call = self.cluster.line_call(self, "grant", w, prefs, self._cap(client))
            call.addBoth(self._claimed, w)
            if spare <= 0:
                return

    def _claimed(self, result: object, w: str) -> None:
        self._claiming.discard(w)
        if (result is None or isinstance(result, Failure)) and self._look_again is None:
            self._look_again = self.reactor.callLater(CLAIM_RETRY, self._again)

    def _again(self) -> None:
        self._look_again = None
        self._claim()

    # -- replaying the stream ------------------------------------------------------------------

    def apply(self, event: Mapping[str, Any]) -> None:
        """One event of the stream, in its order."""
        self._replaying = True
        handler = getattr(self, "_on_" + event["op"], None)
        if handler is not None:
            handler(event, float(event["t"]))

    def applied(self) -> None:
        """The end of a batch of events: claim what is free now."""
        self._replaying = False
        self.line.count()
        self._claim()
        self._drop_if_done()

    def _on_join(self, event: Mapping[str, Any], t: float) -> None:
        w = event["w"]
        item: Any = self._local.get(w) or Remote(w)
        self._items[w] = item
        self._ids[item] = w
        own = self._requests.get(w)
        listener = None if own is None else own.listener
        request = wire.request_of(event["i"], self.line.dispatch, listener)
        self.line.wait(item, request, float(event["a"]), t)

    def _on_admit(self, event: Mapping[str, Any], t: float) -> None:
        asked = wire.request_of(event["i"], self.line.dispatch, None)
        grant, moved = self.line.line.admit(asked.client, asked.rank, t)
        self._hold(event["w"], event["r"], grant, t, asked)
        if moved:
            self.line.tell_rises(t)
            self.line.changed()

    def _on_grant(self, event: Mapping[str, Any], t: float) -> None:
        w = event["w"]
        asked = wire.request_of(event["i"], self.line.dispatch, None)
        item = self._items.pop(w, None)
        moved = False
        if item is None:  # not in this copy (it cannot be, but the slot must count)
            grant, _ = self.line.line.admit(asked.client, asked.rank, t)
        else:
            self._ids.pop(item, None)
            grant, moved = self.line.dispatch.grant(item, t)
            self.line.out_of_line(item)
        self._hold(w, event["r"], grant, t, asked)
        if moved:
            self.line.tell_rises(t)
        self.line.changed()

    def _hold(self, w: str, replica_name: str, grant: Grant, t: float, asked: Request) -> None:
        replica = self._member(replica_name)
        if replica is None:  # an upstream this gateway does not have in this line
            if self._ours(w):  # another gateway's config gave it one: it cannot be used here
                self.cluster.line_call(self, "release", w, replica_name, "").addErrback(_ignore)
                d = self._local.pop(w, None)
                if d is not None and not d.called:
                    log.warn(
                        "granted a slot of {upstream}, which this gateway's line {line} does not "
                        "have: the gateways' configs differ",
                        upstream=replica_name,
                        line=self.key,
                    )
                    d.errback(Unavailable(f"the shared line {self.key} is configured differently"))
            return
        session = asked.want.session if asked.want is not None else None
        trial, capped = self.line.dispatch.started(replica, session, grant.client)
        slot = Slot(self.line, grant, t, replica, trial, id=w)
        self._slots[w] = slot
        self.line.holding[slot] = None
        self.line.count()
        if capped:  # its client's waiters went behind everyone else
            self.line.tell_rises(t)
            self.line.changed()
        if not self._ours(w):
            return
        self._mine[w] = slot
        self._requests.pop(w, None)
        d = self._local.pop(w, None)
        self._ids.pop(d, None)
        if d is None or d.called:  # it gave up meanwhile: the slot goes straight back
            self._cancelled.discard(w)
            slot.release()
            return
        d.callback(slot)

    def _on_release(self, event: Mapping[str, Any], t: float) -> None:
        w = event["w"]
        slot = self._slots.get(w)
        if slot is None:
            return
        if w in self._mine:  # swept while this gateway's request runs: count it again
            self._restore(slot)
            return
        if event.get("x"):
            slot.replica.circuit.abandoned()
        del self._slots[w]
        self.line.give_back(slot, t - slot.granted_at, t)

    def _add_slot(self, slot: Slot) -> bool:
        """Count `slot` as taken in this copy: learnt whole from Redis, or running here. True
        if that capped its client (`Dispatch.hold`)."""
        self._slots[slot.id] = slot
        self.line.holding[slot] = None
        return self.line.dispatch.hold(slot.replica, slot.grant.client)

    def _slot_from(self, w: str, request: str, granted_at: float, replica: Replica) -> Slot:
        """A slot this copy learns from Redis whole (a snapshot, a restore): its request's
        client and class, and no charge to settle."""
        return Slot(self.line, wire.grant_of(request), granted_at, replica, id=w)

    def _restore(self, slot: Slot) -> None:
        info = wire.grant_info(slot.grant)
        self.cluster.line_call(
            self, "restore", slot.id, slot.replica.name, repr(slot.granted_at), info
        ).addErrback(_ignore)

    def _on_restore(self, event: Mapping[str, Any], t: float) -> None:
        w = event["w"]
        if w in self._slots:
            return
        replica = self._member(event["r"])
        if replica is not None and self._add_slot(
            self._slot_from(w, event["i"], float(event["g"]), replica)
        ):
            self.line.tell_rises(t)
            self.line.changed()

    def _on_leave(self, event: Mapping[str, Any], t: float) -> None:
        w = event["w"]
        item = self._items.pop(w, None)
        if item is None:
            return
        d = self._local.pop(w, None)
        swept = d is not None and not d.called  # Redis took this gateway for dead: it is not
        entry = self._waiting_entry(item, t) if swept else None
        self._ids.pop(item, None)
        self._cancelled.discard(w)
        self.line.dequeue(item, t)
        if entry is not None:  # back in line with its first arrival, under a new id
            self._requests.pop(w, None)
            d, request, arrived = entry
            request.listener = self.line.listener_of(d)
            self._ask(request, arrived, d)

    def _on_verdict(self, event: Mapping[str, Any], t: float) -> None:
        replica = self._member(event["r"])
        if replica is not None:
            self.line.judge(replica, event.get("why"), t)

    def _on_probed(self, event: Mapping[str, Any], t: float) -> None:
        replica = self._member(event["r"])
        if replica is not None:
            self.line.probe_reached(replica)

    def _on_idle(self, event: Mapping[str, Any], t: float) -> None:
        """Nobody waits and no slot is held: every gateway starts the fair share afresh here,
        so one that joined later (with no history) has the same line from now on."""
        if not self.line.waiting and not self._slots:
            self.line.forget_line()

    # -- losing Redis and coming back ----------------------------------------------------------

    def _forget_copy(self) -> None:
        self._replaying = False
        self.line.forget_line()
        self._items.clear()
        self._ids = {d: w for w, d in self._local.items()}
        self._claiming.clear()
        self._slots = {}

    def lost(self) -> None:
        """Redis is out of reach: nothing is granted. The copy stays as it was, every waiter
        in its place, until the link is back or the grace is over; with a `fallback_share`, it
        keeps only this gateway's running requests and waiters, which wait on in their order
        for that share of each upstream's slots, granted here."""
        line = self.line
        share = self.cluster.config.fallback_share
        self._replaying = False
        self._claiming.clear()
        if not share:
            for member in line.members:
                member.share = 0.0
            line.count()
            return
        now = self.clock.seconds()
        staying = [
            self._waiting_entry(d, now) for d in line.dispatch.order(now) if self._waits_here(d)
        ]
        local, self._local = self._local, {}
        self._requests.clear()
        self._cancelled.clear()
        self._forget_copy()
        for slot in self._mine.values():
            self._add_slot(slot)
        for member in line.members:
            member.share = share
        for d, request, arrived in staying:
            line.enqueue(d, request, arrived)
        line.count()
        for d in local.values():
            if not d.called and d not in line.dispatch:
                d.errback(Unavailable("lost the shared line"))
        self.fallback.grant_free()
        line.tell_all(now)

    def outage_over(self, reason: Exception) -> None:
        """The outage outlasted the grace: this gateway's waiters hear `reason`, and leave;
        with a `fallback_share` they wait on for their share of the slots."""
        if not self.cluster.config.fallback_share:
            self._fail_here(reason)

    def _fail_here(self, reason: Exception) -> None:
        """This gateway's waiters in the copy leave it, and hear `reason`."""
        line = self.line
        now = self.clock.seconds()
        leaving = [d for d in line.dispatch.order(now) if not isinstance(d, Remote)]
        for d in leaving:
            line.dispatch.leave(d)
            line.out_of_line(d)
            w = self._ids.get(d)
            if w is not None and self._local.get(w) is d:
                self._give_up(w)
        line.tell_rises(now)
        line.changed()
        for d in leaving:
            if not d.called:
                d.errback(reason)

    def _waits_here(self, item: Any) -> bool:
        w = self._ids.get(item)
        return w is not None and self._local.get(w) is item and w not in self._cancelled

    def _waiting_entry(self, d: Any, now: float) -> tuple[Any, Request, float]:
        """One of this gateway's waiters, to move between the shared line and the fallback
        share in its place: what it asked for and when it arrived (a retry: now, its place
        is ahead of the line)."""
        dispatch = self.line.dispatch
        client, rank, arrived, retry = dispatch.arrival(d)
        request = Request(client, rank, dispatch.want_of(d), retry, None)
        return d, request, now if retry else arrived

    def rebuild(
        self, now: float, waiting: Mapping[str, str], slots: Mapping[str, Mapping[str, str]]
    ) -> None:
        """Make the copy anew from a snapshot taken at Redis time `now`. Fair-share history
        starts afresh (until the line is next idle, this copy may order clients differently
        from the others': claims stay safe, Redis takes one per slot)."""
        line = self.line
        self.clock.offset = now - self.reactor.seconds()
        waited = (
            []
            if self.cluster.live
            else [
                self._waiting_entry(d, now)
                for d in line.dispatch.order(now)
                if not isinstance(d, Remote)
            ]
        )
        if not self.cluster.live:  # a join that ran, its event not replayed before the link went
            waited += [
                (d, self._requests[w], now)
                for w, d in self._local.items()
                if d not in line.dispatch and not d.called and w in self._requests
            ]
        for member in line.members:
            member.share = None
        self._forget_copy()
        for name, entries in slots.items():
            replica = self._member(name)
            if replica is None:
                continue
            for w, raw in entries.items():
                slot = self._mine.get(w)
                if slot is None:
                    entry = orjson.loads(raw)
                    slot = self._slot_from(w, entry["i"], float(entry["t"]), replica)
                self._add_slot(slot)
                if self._ours(w) and w not in self._mine:
                    d = self._local.pop(w, None)
                    if d is not None and not d.called:  # admitted just before the snapshot
                        self._mine[w] = slot
                        self._requests.pop(w, None)
                        d.callback(slot)
                    elif not self.cluster.running(w):  # its request is gone: give it back
                        self._mine[w] = slot
                        slot.release()
        for w, slot in self._mine.items():
            if w not in self._slots:  # Redis lost it while its request runs
                self._add_slot(slot)
                self._restore(slot)
        arrivals = sorted(waiting.items(), key=lambda kv: float(orjson.loads(kv[1])["a"]))
        for w, raw in arrivals:
            entry = orjson.loads(raw)
            if self._ours(w) and w not in self._local:
                self.cluster.line_call(self, "leave", w).addErrback(_ignore)
            self._on_join({"w": w, "i": entry["i"], "a": entry["a"]}, now)
        for d, request, arrived in waited:  # waited out the outage: back in line, in place
            if d.called:  # granted (it was served in its turn meanwhile), or given up
                self._ids.pop(d, None)
                continue
            if d in line.dispatch:  # Redis had it
                continue
            w = self._ids.pop(d, None)
            if w is not None and self._local.get(w) is d:  # its join never ran, or was lost
                del self._local[w]
                self._requests.pop(w, None)
            request.listener = line.listener_of(d)
            self._ask(request, arrived, d)
        line.count()
        line.tell_all(now)

    def adopt(self, old: PositionedSemaphore) -> None:
        """A reload gave a model more replicas: this gateway's waiters of `old` whose replicas
        are now this line's leave `old` and join this one, keeping their arrival time."""
        source = old.source
        assert isinstance(source, RedisSource)
        for w, d in list(source._local.items()):
            request = source._requests.get(w)
            if request is None or d.called:
                continue
            adoptable, want = self.line.dispatch.want_here(request.want)
            if not adoptable:
                continue
            request.want = want
            item = source._items.get(w)
            arrived = None
            if item in old.dispatch:
                *_, arrived, retry = old.dispatch.arrival(item)
                arrived = None if retry else arrived  # a retry's place is ahead of the line
            source._give_up(w)
            self.line.take_listener(old, d)
            self.line.take_over(old, d)
            self._ask(request, arrived, d)
        source.retired = True  # its key named upstreams of which this line took some
        source._drop_if_done()

    def close(self) -> None:
        if self._look_again is not None and self._look_again.active():
            self._look_again.cancel()
        self._look_again = None
