"""The listen string: checked before the reactor runs, and given a listen queue that a burst
of clients cannot overflow."""

from __future__ import annotations

import re
from collections.abc import Callable

# Twisted listens with a backlog of 50: a burst of a few thousand clients connecting at once
# overflows it, and they wait for SYN retries (seconds each) or see resets. Linux caps the value
# at net.core.somaxconn (4096 by default since 5.4), so asking for that costs nothing more.
DEFAULT_BACKLOG = 4096
_TAKES_BACKLOG = ("tcp", "tcp6", "ssl", "unix")


def with_backlog(description: str, backlog: int = DEFAULT_BACKLOG) -> str:
    """The listen string with `backlog=` added, unless the operator set one or the endpoint
    has no listen queue of ours (systemd passes a socket it already listens on)."""
    kind = description.split(":", 1)[0].strip().lower()
    if kind not in _TAKES_BACKLOG or re.search(r"(?i)(?<!\\):backlog=", description):
        return description
    return f"{description}:backlog={backlog}"


def endpoint_problem(description: str) -> str | None:
    """What is wrong with a listen string Twisted could not parse, before the reactor runs.

    `serverFromString` only builds the endpoint object (nothing listens until `.listen`), so it
    is safe to call with no reactor; a typo then fails start-up naming the key rather than with
    a traceback from deep in twistd.
    """
    from twisted.internet.endpoints import serverFromString

    try:
        serverFromString(None, description)
    except (ValueError, TypeError, KeyError) as e:
        return f"bad endpoint string {description!r}: {e}"
    port = re.match(r"(?i)tcp6?:(\d+)", description)
    if port and int(port.group(1)) > 65535:
        return f"bad endpoint string {description!r}: port must be 0-65535"
    return None


def check_endpoint(description: str, error: Callable[[str], Exception]) -> None:
    """Raise `error(problem)` for a listen string Twisted could not parse (`--listen` too)."""
    problem = endpoint_problem(description)
    if problem is not None:
        raise error(problem)
