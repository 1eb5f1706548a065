"""`residency.plan`: examples of each rule, then a box simulated tick by tick under generated
workloads: memory never over the box, no model unloaded while it runs a request, every waiter
served within the stated bound, and a finite number of loads."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from homelab_gateway.core.residency import HOLDING, IDLE_GRACE, Model, plan


def test_with_room_a_waited_for_model_loads_at_once() -> None:
    p = plan(24, 30, [Model("a", 10, "unloaded", waiting=1, head=(1, 5.0))], now=5)
    assert p.load == ["a"] and not p.unload and not p.hold


def test_models_load_in_the_line_order_and_free_memory_waits_for_the_first_that_does_not_fit() -> (
    None
):
    models = [
        Model("late-small", 4, "unloaded", waiting=1, head=(1, 9.0)),
        Model("early-big", 20, "unloaded", waiting=1, head=(1, 2.0)),
        Model("first", 8, "unloaded", waiting=1, head=(0, 7.0)),
    ]
    p = plan(24, 30, models, now=10)
    # interactive first; then early-big does not fit in what is left, and late-small, which
    # would, waits behind it rather than take its memory.
    assert p.load == ["first"]


def test_an_idle_model_is_unloaded_at_once_for_another_models_waiter() -> None:
    models = [
        Model("coder", 18, "loaded", loaded_at=90.0, idle_since=97.0),
        Model("chat", 10, "unloaded", waiting=1, head=(1, 100.0)),
    ]
    p = plan(24, 30, models, now=100)
    assert p.unload == ["coder"] and not p.load


def test_a_model_between_two_requests_of_its_client_is_not_idle_yet() -> None:
    models = [
        Model("coder", 18, "loaded", loaded_at=90.0, idle_since=99.5),
        Model("chat", 10, "unloaded", waiting=1, head=(1, 98.0)),
    ]
    p = plan(24, 30, models, now=100)
    assert not p.unload and p.wake == 99.5 + IDLE_GRACE


def test_a_model_with_work_keeps_its_memory_for_min_resident() -> None:
    models = [
        Model("coder", 18, "loaded", running=1, waiting=1, head=(1, 99.0), loaded_at=90.0),
        Model("chat", 10, "unloaded", waiting=1, head=(1, 95.0)),
    ]
    p = plan(24, 30, models, now=100)
    assert not p.unload and not p.hold and p.wake == 120.0
    p = plan(24, 30, models, now=120)
    assert p.hold == {"coder"} and not p.unload and not p.load


def test_a_model_whose_first_waiter_comes_first_is_not_given_up() -> None:
    models = [
        Model("coder", 18, "loaded", running=1, waiting=1, head=(1, 50.0), loaded_at=0.0),
        Model("chat", 10, "unloaded", waiting=1, head=(1, 95.0)),
    ]
    assert plan(24, 30, models, now=100).hold == set()


def test_memory_still_unloading_counts_as_coming() -> None:
    models = [
        Model("old", 18, "unloading"),
        Model("busy", 6, "loaded", running=1, loaded_at=0.0),
        Model("chat", 10, "unloaded", waiting=1, head=(1, 95.0)),
    ]
    p = plan(24, 30, models, now=100)
    assert not p.hold and not p.unload and not p.load


def test_nothing_is_given_up_unless_the_room_is_enough() -> None:
    models = [
        Model("a", 8, "loaded", loaded_at=0.0, idle_since=1.0),
        Model("b", 8, "loaded", running=1, waiting=1, head=(0, 1.0), loaded_at=0.0),
        Model("c", 20, "unloaded", waiting=1, head=(1, 95.0)),
    ]
    p = plan(24, 30, models, now=100)
    assert not p.unload and not p.hold


def test_idle_unload() -> None:
    model = Model("a", 8, "loaded", loaded_at=0.0, idle_since=50.0, idle_unload=60.0)
    assert plan(24, 30, [model], now=100).wake == 110.0
    assert plan(24, 30, [model], now=110).unload == ["a"]
    assert plan(24, 30, [Model("a", 8, "loaded", idle_since=0.0)], now=1e9).unload == []


def test_idle_unload_shorter_than_the_idle_grace_is_kept() -> None:
    """`idle_unload` is the operator's own grace: it counts from the last request's end, and
    the plan wakes for it even while IDLE_GRACE (a swap's grace) has not passed."""
    assert IDLE_GRACE > 1
    model = Model("a", 8, "loaded", loaded_at=0.0, idle_since=100.0, idle_unload=1.0)
    assert plan(24, 30, [model], now=100).wake == 101.0
    assert plan(24, 30, [model], now=101).unload == ["a"]


# The simulated box: one tick a second, one class, each line FIFO.
@dataclass
class Server:
    memory: int
    slots: int
    load_time: int
    stop_time: int
    idle_unload: int
    state: str = "unloaded"
    until: int = 0  # when a load or an unload ends
    loaded_at: float | None = None
    idle_since: float | None = 0.0
    queue: deque[tuple[int, int, int]] = field(default_factory=deque)  # (arrival, id, duration)
    running: list[int] = field(default_factory=list)  # end times
    loads: int = 0


@dataclass
class Workload:
    box: int
    min_resident: int
    servers: list[Server]
    requests: list[tuple[int, int, int]]  # (arrival, server, duration)


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    box = draw(st.integers(2, 6))
    servers = [
        Server(
            memory=draw(st.integers(1, box)),
            slots=draw(st.integers(1, 2)),
            load_time=draw(st.integers(1, 3)),
            stop_time=draw(st.integers(0, 2)),
            idle_unload=draw(st.sampled_from([0, 0, 2, 5])),
        )
        for _ in range(draw(st.integers(1, 4)))
    ]
    requests = draw(
        st.lists(
            st.tuples(st.integers(0, 20), st.integers(0, len(servers) - 1), st.integers(1, 5)),
            min_size=1,
            max_size=14,
        )
    )
    return Workload(box, draw(st.integers(0, 6)), servers, sorted(requests))


def simulate(w: Workload) -> dict[int, tuple[int, int]]:
    """Each request's (arrival, start), checking the invariants at every tick."""
    pending = deque(enumerate(w.requests))
    started: dict[int, tuple[int, int]] = {}
    for now in range(10_000):
        for s in w.servers:
            s.running = [end for end in s.running if end > now]
            if s.state == "loading" and s.until <= now:
                s.state, s.loaded_at = "loaded", float(now)
            if s.state == "unloading" and s.until <= now:
                s.state, s.loaded_at = "unloaded", None
        while pending and pending[0][1][0] <= now:
            i, (arrival, k, duration) = pending.popleft()
            w.servers[k].queue.append((arrival, i, duration))
        for s in w.servers:
            busy = s.running or s.queue
            s.idle_since = None if busy else (now if s.idle_since is None else s.idle_since)
        p = plan(w.box, w.min_resident, models(w), now)
        for name in p.unload:
            s = w.servers[int(name)]
            assert s.state == "loaded" and not s.running, "unloaded while it runs a request"
            s.state, s.until = "unloading", now + s.stop_time
        for name in p.load:
            s = w.servers[int(name)]
            assert s.state == "unloaded"
            s.state, s.until, s.loads = "loading", now + s.load_time, s.loads + 1
        assert sum(s.memory for s in w.servers if s.state in HOLDING) <= w.box
        for k, s in enumerate(w.servers):
            if s.state != "loaded" or str(k) in p.hold:
                continue
            while s.queue and len(s.running) < s.slots:
                arrival, i, duration = s.queue.popleft()
                s.running.append(now + duration)
                started[i] = (arrival, now)
        if len(started) == len(w.requests):
            return started
    raise AssertionError("a waiter was never served")


def models(w: Workload) -> list[Model]:
    return [
        Model(
            str(k),
            s.memory,
            s.state,
            running=len(s.running),
            waiting=len(s.queue),
            head=(0, s.queue[0][0], s.queue[0][1]) if s.queue else None,
            loaded_at=s.loaded_at,
            idle_since=s.idle_since,
            idle_unload=s.idle_unload,
        )
        for k, s in enumerate(w.servers)
    ]


def bound(w: Workload, arrival: int) -> int:
    """The stated bound: the requests that arrived no later than it, each run alone, and for
    each of them a swap (min_resident, a drain, a stop, a load)."""
    swap = w.min_resident + 5 + max(s.stop_time for s in w.servers)
    swap += max(s.load_time for s in w.servers)
    ahead = [d for a, _, d in w.requests if a <= arrival]
    return sum(ahead) + len(ahead) * swap


@settings(max_examples=300)
@given(workloads())
def test_the_simulated_box_serves_everyone_within_the_bound(w: Workload) -> None:
    started = simulate(w)
    for arrival, start in started.values():
        assert start - arrival <= bound(w, arrival)
    assert sum(s.loads for s in w.servers) <= len(w.requests) + len(w.servers)


def test_two_clients_alternating_two_models_swap_once_per_min_resident() -> None:
    """An agent calling a coder and a chat model in turn, A B A B, every 2 s for 2 minutes, on
    a box that holds one of them: each model's work goes together, not one swap per call."""
    coder = Server(memory=18, slots=4, load_time=5, stop_time=1, idle_unload=0)
    chat = Server(memory=10, slots=4, load_time=5, stop_time=1, idle_unload=0)
    requests = [(t, (t // 2) % 2, 3) for t in range(0, 120, 2)]
    w = Workload(box=24, min_resident=30, servers=[coder, chat], requests=requests)
    started = simulate(w)
    loads = coder.loads + chat.loads
    assert loads <= 2 + 120 // 30, loads
    waits = [start - arrival for arrival, start in started.values()]
    # at worst: the other model's load, its min_resident, a drain, a stop and a load
    assert max(waits) <= 5 + 30 + 3 + 1 + 5
    by_model = [
        [started[i][1] - a for i, (a, k, _) in enumerate(requests) if k == m] for m in (0, 1)
    ]
    # fair: neither model's requests wait much longer than the other's on the whole
    means = [sum(x) / len(x) for x in by_model]
    assert max(means) <= 2 * min(means) + 10
