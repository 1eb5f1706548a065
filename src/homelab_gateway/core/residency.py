"""Which models a box holds: what to load, what to unload, and what to stop granting (sans-IO).

A box's models share its accelerator memory. Each managed upstream has its own line; the box
compares their first waiters, `Model.head`: the class that waiter is served as (aging
included), then its arrival, lower first. That is the line's own order, so a swap follows the
same fairness as a slot. `plan` is the whole policy, called whenever anything changes (a
waiter, a grant, a finished request, a load, an exit) and at the `Plan.wake` it names:

1. **Idle unload**: a loaded model with nothing running or waiting for `idle_unload` seconds is
   unloaded (0 means only for another model).
2. **Loads in the line's order**: unloaded models with waiters are taken best head first; each
   one that fits in the free memory starts loading at once. The first that does not fit stops
   the walk: the memory that is free is kept for it, so a big model is never starved by small
   ones that keep fitting.
3. **Room for that first one**: memory that is unloading counts as coming. Beyond it, loaded
   models are given up, least deserving first: idle ones (nothing running or waiting for
   `IDLE_GRACE` seconds) at once; one with work only once it has been loaded `min_resident`
   seconds and its own head (if any) comes after the blocked one's. A model given up gets no
   more grants (`Plan.hold`) and is unloaded once its running requests end: no answer is ever
   cut for a swap. Nothing is given up unless the room is enough.

`min_resident` makes work for one model go together: a model with work keeps the memory that
long, and each load serves every request then waiting for that model, so two clients calling
two models that do not fit together load each once per run of requests, not once per call (an
idle model still goes after `IDLE_GRACE`: nobody waits for it). A waiter at the head of
its model's line waits at most for the requests ahead of it in the line's order on the models
holding the memory, plus the load of the model in its place, its `min_resident`, one drain (the
longest running request), one stop and one load (docs/operations.md, "Models loaded on
demand").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

STATES = ("unloaded", "loading", "loaded", "unloading", "failed")
HOLDING = ("loading", "loaded", "unloading")
"""The states whose memory counts as used: from the server's start until its process exits."""

Rank = tuple[Any, ...]
IDLE_GRACE = 2.0
"""Seconds a model with nothing running or waiting still counts as busy: the time a client
takes to send its next request after an answer. Without it, two clients each calling their own
model would swap at every gap between one answer and the next request."""


@dataclass(frozen=True, slots=True)
class Model:
    """One managed upstream of a box, as the plan sees it."""

    name: str
    memory: float
    state: str
    running: int = 0
    waiting: int = 0
    head: Rank | None = None  # its line's first waiter: (class served as, arrival)
    loaded_at: float | None = None  # when its health probe first answered
    idle_since: float | None = None  # when it last had nothing running or waiting
    idle_unload: float = 0.0  # seconds; 0: only when another model needs the memory


@dataclass(slots=True)
class Plan:
    load: list[str] = field(default_factory=list)
    unload: list[str] = field(default_factory=list)
    hold: set[str] = field(default_factory=set)
    wake: float | None = None  # when to plan again if nothing else changes

    def wake_by(self, moment: float) -> None:
        self.wake = moment if self.wake is None else min(self.wake, moment)


def plan(memory: float, min_resident: float, models: Iterable[Model], now: float) -> Plan:
    """What the box does next; see the module's docstring for the rule."""
    models = list(models)
    out = Plan()
    free = memory - sum(m.memory for m in models if m.state in HOLDING)
    for m in models:
        if m.state == "loaded" and m.idle_unload and _unused(m) and m.idle_since is not None:
            if now - m.idle_since >= m.idle_unload:
                out.unload.append(m.name)
            else:
                out.wake_by(m.idle_since + m.idle_unload)
    wanting = sorted(
        (m for m in models if m.state == "unloaded" and m.waiting and m.head is not None),
        key=lambda m: m.head,  # type: ignore[arg-type, return-value]
    )
    for m in wanting:
        if m.memory <= free:
            out.load.append(m.name)
            free -= m.memory
            continue
        _make_room(m, m.memory - free, models, min_resident, now, out)
        break
    return out


def _make_room(
    blocked: Model, need: float, models: list[Model], min_resident: float, now: float, out: Plan
) -> None:
    """Give up loaded models for `blocked`, if enough of them may go."""
    need -= sum(m.memory for m in models if m.state == "unloading")
    need -= sum(m.memory for m in models if m.name in out.unload)
    if need <= 0:
        return
    assert blocked.head is not None
    may_go: list[Model] = []
    for m in models:
        if m.state != "loaded" or m.name in out.unload:
            continue
        if m.head is not None and m.head <= blocked.head:
            continue  # its own first waiter comes first
        if _idle(m, now):
            may_go.append(m)
        elif m.loaded_at is not None and now - m.loaded_at < min_resident:
            out.wake_by(m.loaded_at + min_resident)
            if not m.running and not m.waiting and m.idle_since is not None:
                out.wake_by(m.idle_since + IDLE_GRACE)
        else:
            may_go.append(m)
    chosen: list[Model] = []
    for m in _least_deserving_first(may_go, now):
        if need <= 0:
            break
        chosen.append(m)
        need -= m.memory
    if need > 0:
        return
    for m in chosen:
        if m.running:
            out.hold.add(m.name)
        else:
            out.unload.append(m.name)


def _least_deserving_first(models: list[Model], now: float) -> list[Model]:
    """Idle models, then those with nothing waiting, then by head, the latest first."""
    idle = [m for m in models if _idle(m, now)]
    running_only = [m for m in models if not _idle(m, now) and m.head is None]
    waited = sorted(
        (m for m in models if m.head is not None),
        key=lambda m: m.head,  # type: ignore[arg-type, return-value]
        reverse=True,
    )
    return idle + running_only + waited


def _unused(m: Model) -> bool:
    return not m.running and not m.waiting


def _idle(m: Model, now: float) -> bool:
    """Unused for `IDLE_GRACE`: another model may have its memory at once."""
    if not _unused(m):
        return False
    return m.idle_since is None or now - m.idle_since >= IDLE_GRACE
