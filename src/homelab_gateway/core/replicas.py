"""Which replica a request goes to, and whether a replica is in rotation (sans-IO).

A model may be served by several upstreams (replicas). Two decisions are made here, on plain
values, so they are tested without a reactor:

- `Circuit`: a replica's health, from what its requests met. Failures in a row (a refused
  connection, a timeout before the response headers, a 5xx before any body) take it out of
  rotation (`down`) for `cooldown` seconds; then it lets one trial request through
  (`half-open`): a success puts it back (`up`), a failure takes it out again. A successful
  background probe puts it back at once.
- `choose`: among the replicas with a free slot, the one a request goes to: fallbacks only when
  no other replica has a free slot; then the replica that served the request's session last
  (its prefix cache is there); then the one with the most free slots, ties in turn.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

UP, DOWN, HALF_OPEN = "up", "down", "half-open"
SESSIONS_REMEMBERED = 10_000
"""Sessions whose last replica a line remembers (least recently used forgotten first): each
keyed by its `session_key`, about 150 bytes, so at most about 1.5 MB however many pass."""


@dataclass
class Circuit:
    failures_to_open: int = 3
    cooldown: float = 30.0
    state: str = UP
    failures: int = 0  # in a row, while up
    down_since: float | None = None
    retry_at: float | None = None  # while down: when one trial request may go
    trial: bool = False  # while half-open: the trial request is out
    last_error: str | None = None

    def admits(self, now: float) -> bool:
        """Whether a request may start on this replica now."""
        if self.state == UP:
            return True
        if self.state == DOWN:
            return self.retry_at is not None and now >= self.retry_at
        return not self.trial

    def begin(self) -> bool:
        """A request starts on this replica (`admits` said yes); True if it is the trial."""
        if self.state == UP:
            return False
        self.state, self.trial = HALF_OPEN, True
        return True

    def failed(self, now: float, reason: str) -> str | None:
        """A request met a failure that is the replica's fault; the new state if it changed."""
        self.last_error = reason
        if self.state == DOWN:
            return None  # a request that started before it went down
        if self.state == UP:
            self.failures += 1
            if self.failures < self.failures_to_open:
                return None
            self.down_since = now
        self.state, self.trial, self.failures = DOWN, False, 0
        self.retry_at = now + self.cooldown
        return DOWN

    def succeeded(self) -> str | None:
        """A request got its response from this replica; the new state if it changed."""
        self.failures = 0
        return self._up()

    def abandoned(self) -> None:
        """The trial ended with no verdict (its client left first): the next request tries."""
        if self.state == HALF_OPEN:
            self.trial = False

    def probed(self) -> str | None:
        """A background probe got an answer: the replica is back."""
        return self._up()

    def _up(self) -> str | None:
        if self.state == UP:
            return None
        self.state, self.trial, self.down_since, self.retry_at = UP, False, None, None
        return UP


class Candidate(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def fallback(self) -> bool: ...

    @property
    def free(self) -> int: ...


C = TypeVar("C", bound=Candidate)


def choose(candidates: Sequence[C], last: str | None, turn: int) -> C:
    """The replica (of `candidates`, each with a free slot) a request goes to. `last` is the
    replica that served its session last, `turn` a counter that rotates ties."""
    tier = [c for c in candidates if not c.fallback] or candidates
    for candidate in tier:
        if candidate.name == last:
            return candidate
    most = max(c.free for c in tier)
    best = [c for c in tier if c.free == most]
    return best[turn % len(best)]


def session_key(value: str | bytes | None) -> str | None:
    """A fixed-size name for a client's session (a header or `metadata.user_id` of any size),
    so the session table, every waiter and the shared line's events hold 32 characters, never
    what the client sent; None for no session."""
    if not value:
        return None
    raw = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


class Sessions:
    """The replica each session was served on last, for the `SESSIONS_REMEMBERED` most recent
    sessions."""

    def __init__(self, size: int = SESSIONS_REMEMBERED) -> None:
        self.size = size
        self._last: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def get(self, session: str | None) -> str | None:
        return None if session is None else self._last.get(session)

    def served(self, session: str | None, replica: str) -> None:
        if session is None:
            return
        self._last[session] = replica
        self._last.move_to_end(session)
        if len(self._last) > self.size:
            self._last.popitem(last=False)
