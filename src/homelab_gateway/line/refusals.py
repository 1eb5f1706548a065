"""Why the line refuses a request a place: a full queue, or a shared line that cannot reach
Redis. Raised by the line (`limiter`, `shared`), answered by the surfaces as 529s."""

from __future__ import annotations


class QueueFull(Exception):
    """The queue already holds `queue_limit` waiters."""


class Unavailable(Exception):
    """The line is shared through Redis and Redis cannot be reached: no slot can be granted
    without risking the cap (`shared.RedisSource`)."""


class ClientQueueFull(QueueFull):
    """This client already has `max_waiting` waiters; others may still queue."""

    def __init__(self, client: str, limit: int) -> None:
        super().__init__(client, limit)
        self.client = client
        self.limit = limit
