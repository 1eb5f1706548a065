"""The upstream connection pool hands connections out in the order they were asked for."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import TestCase

from homelab_gateway.upstream.connections import UpstreamPool

KEY = ("http", b"127.0.0.1", 8000)


class Transport:
    disconnecting = False

    def abortConnection(self) -> None:
        self.disconnecting = True

    def loseConnection(self) -> None:
        self.disconnecting = True


class Connection:
    """What the pool keeps of an HTTP/1.1 client connection: its state and its transport."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.state = "QUIESCENT"
        self.transport = Transport()

    def __repr__(self) -> str:
        return self.name


class Endpoint:
    """Connects only when the test says so."""

    def __init__(self) -> None:
        self.connects: list[Deferred[Any]] = []
        self.cancelled: list[Deferred[Any]] = []

    def connect(self, factory: Any) -> Deferred[Any]:
        d: Deferred[Any] = Deferred(self.cancelled.append)
        self.connects.append(d)
        return d


class HandsOutInOrder(TestCase):
    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.pool = UpstreamPool(self.reactor)
        self.pool.retryAutomatically = False  # POST is never retried: the connection itself
        self.endpoint = Endpoint()

    def ask(self) -> tuple[Deferred[Any], list[Any]]:
        d = self.pool.getConnection(KEY, self.endpoint)
        got: list[Any] = []
        d.addBoth(got.append)
        return d, got

    def test_an_idle_connection_with_nobody_waiting_is_handed_out_at_once(self) -> None:
        idle = Connection("idle")
        self.pool._putConnection(KEY, idle)
        _, got = self.ask()
        self.assertEqual(got, [idle])
        self.assertEqual(self.endpoint.connects, [])

    def test_a_request_waiting_for_a_connect_is_not_overtaken(self) -> None:
        """The first grant finds no idle connection and connects; the answer before it gives
        its connection back, and the next grant comes before the reactor's next turn: the
        returned connection goes to the first, the second takes the first's connect."""
        _, first = self.ask()
        [connect] = self.endpoint.connects
        returned = Connection("returned")
        self.pool._putConnection(KEY, returned)
        _, second = self.ask()
        self.assertEqual(first, [returned], "the oldest ask gets the first connection ready")
        self.assertEqual(second, [], "overtook the first")
        self.assertEqual(len(self.endpoint.connects), 1, "the first's connect serves the second")
        made = Connection("made")
        connect.callback(made)
        self.assertEqual(second, [made])

    def test_a_returned_connection_goes_to_a_waiting_ask_on_the_next_turn(self) -> None:
        """Twisted returns a connection before it lets go of the response that just ended: a
        request written on it then would lose its parser."""
        _, first = self.ask()
        returned = Connection("returned")
        self.pool._putConnection(KEY, returned)
        self.assertEqual(first, [])
        self.reactor.advance(0)
        self.assertEqual(first, [returned])
        made = Connection("made")
        self.endpoint.connects[0].callback(made)
        self.assertEqual(self.pool._connections[KEY], [made], "kept for the next request")

    def test_closing_cancels_a_connect_a_returned_connection_made_spare(self) -> None:
        _, first = self.ask()
        [connect] = self.endpoint.connects
        self.pool._putConnection(KEY, returned := Connection("returned"))
        self.reactor.advance(0)
        self.assertEqual(first, [returned])
        self.pool.closeCachedConnections()
        self.assertEqual(self.endpoint.cancelled, [connect])
        self.assertEqual(self.pool._asks, {})

    def test_a_failed_connect_fails_the_oldest_ask_it_leaves_uncovered(self) -> None:
        _, first = self.ask()
        _, second = self.ask()
        one, two = self.endpoint.connects
        one.errback(ConnectionRefusedError())
        [failure] = first
        failure.trap(ConnectionRefusedError)
        self.assertEqual(second, [])
        made = Connection("made")
        two.callback(made)
        self.assertEqual(second, [made])

    def test_a_failed_connect_that_another_covers_fails_nobody(self) -> None:
        _, first = self.ask()
        _, second = self.ask()
        one, two = self.endpoint.connects
        self.pool._putConnection(KEY, Connection("returned"))
        self.reactor.advance(0)
        one.errback(ConnectionRefusedError())
        self.assertEqual(second, [], "its own connect is still under way")
        two.callback(Connection("made"))
        self.assertEqual([c.name for c in first + second], ["returned", "made"])

    def test_a_request_that_leaves_cancels_the_connect_nobody_needs(self) -> None:
        d, first = self.ask()
        [connect] = self.endpoint.connects
        d.cancel()
        first[0].trap(CancelledError)
        self.assertEqual(self.endpoint.cancelled, [connect])
        self.assertEqual(self.pool._asks, {})
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_a_request_that_leaves_keeps_a_connect_another_waits_for(self) -> None:
        leaving, _ = self.ask()
        _, staying = self.ask()
        one, two = self.endpoint.connects
        leaving.cancel()
        self.assertEqual(self.endpoint.cancelled, [two], "the newest connect, now spare")
        made = Connection("made")
        one.callback(made)
        self.assertEqual(staying, [made])

    def test_a_waiting_ask_that_leaves_cancels_the_next_turns_handout(self) -> None:
        d, _ = self.ask()
        self.pool._putConnection(KEY, returned := Connection("returned"))
        d.cancel()
        self.assertEqual(self.pool._asks, {})
        self.assertEqual(
            [c.func for c in self.reactor.getDelayedCalls()],
            [self.pool._removeConnection],
            "only the idle connection's own timeout is left",
        )
        _, got = self.ask()
        self.assertEqual(got, [returned])

    def test_an_idle_connection_lost_meanwhile_is_skipped(self) -> None:
        _, first = self.ask()
        lost = Connection("lost")
        self.pool._putConnection(KEY, lost)
        lost.state = "CONNECTION_LOST"
        self.reactor.advance(0)
        self.assertEqual(first, [], "handed a dead connection")
        self.assertNotIn(lost, self.pool._connections.get(KEY, []))
        made = Connection("made")
        self.endpoint.connects[0].callback(made)
        self.assertEqual(first, [made])
