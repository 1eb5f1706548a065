"""One call per socket read, not per HTTP chunk, for a response body.

Twisted's HTTP client hands a body to its protocol one transfer-encoding chunk at a time, and a
streaming upstream (vLLM, the stub) sends one chunk per token: a single socket read of 64 KB
carries a few hundred of them. Handled one by one, each would cost the gateway a client write
and two timer resets. `ReadBatcher` collects the pieces one read delivers and hands them on
joined when that read has been parsed, so each read is still passed on as soon as it has been
read (nothing waits for a later one), once.

The end of a read is only visible to the protocol the socket transport calls, so the batcher
wraps that protocol's `dataReceived` for as long as the body lasts. Where it cannot find that
protocol (a test's in-memory transport, an unknown transport), it passes each piece on at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ReadBatcher:
    def __init__(self, deliver: Callable[[bytes], None]) -> None:
        self._deliver = deliver
        self._pending: list[bytes] = []
        self._reading = False
        self._protocol: Any = None

    def attach(self, body_transport: Any) -> None:
        """Hook the end of each socket read under `body_transport` (the transport Twisted
        gives a response's body protocol: a proxy for the connection's socket transport)."""
        socket = getattr(body_transport, "_producer", None)
        # The protocol a TCP transport calls (`protocol`), or the one TLS calls with plain text.
        protocol = getattr(socket, "wrappedProtocol", None) or getattr(socket, "protocol", None)
        if protocol is None or "dataReceived" in vars(protocol):
            return  # not found, or another body still holds it: deliver piece by piece
        parse = protocol.dataReceived

        def read(data: bytes) -> None:
            self._reading = True
            try:
                parse(data)
            finally:
                self._reading = False
                self.flush()

        protocol.dataReceived = read
        self._protocol = protocol

    def add(self, data: bytes) -> None:
        if self._reading:
            self._pending.append(data)
        else:
            self._deliver(data)

    def flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            self._deliver(data)

    def detach(self) -> None:
        """The body ended: pass on what this read brought so far and unhook, so the pooled
        connection's next response is parsed by Twisted alone."""
        self.flush()
        if self._protocol is not None:
            vars(self._protocol).pop("dataReceived", None)
            self._protocol = None
