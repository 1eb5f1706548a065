"""Whether Redis is answering, judged from its answers and this gateway's own turns (sans-IO).

A reply that Redis sent in time may sit unread while this gateway's reactor is busy (a burst of
thousands of clients): a timer set at the command would then find it "late" and drop a link
that is fine. So silence is counted by `tick`, which the reactor runs every `step` seconds: a
tick adds at most `step`, however late it runs, and the reactor reads its sockets between two
ticks, so the time it was away counts for one step, not as Redis's silence.
"""

from __future__ import annotations


class Liveness:
    """Commands awaiting a reply on one connection, and how long Redis has been silent."""

    def __init__(self, timeout: float, step: float) -> None:
        self.timeout = timeout
        self.step = step
        self.waiting = 0  # commands sent and not answered
        self.silent = 0.0  # counted seconds without an answer while some wait
        self._last: float | None = None

    def asked(self) -> None:
        if not self.waiting:
            self.silent = 0.0
        self.waiting += 1

    def answered(self) -> None:
        """A reply (or an error reply) came: Redis is there."""
        self.waiting = max(0, self.waiting - 1)
        self.silent = 0.0

    def tick(self, now: float) -> bool:
        """The reactor's turn at `now`; True if Redis has been silent for `timeout` seconds of
        turns while a command waited."""
        elapsed = 0.0 if self._last is None else min(max(0.0, now - self._last), self.step)
        self._last = now
        if self.waiting:
            self.silent += elapsed
        return self.silent >= self.timeout
