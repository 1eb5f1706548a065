"""`--load-time`: the stub opens its port only once its "model" is loaded, as vLLM does."""

from __future__ import annotations

from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import TestCase

from homelab_gateway.dev.stub import LoadingService, Options, StubLog, StubSettings, stub_site


class LoadTime(TestCase):
    def service(self, load_time: float) -> tuple[MemoryReactorClock, LoadingService]:
        reactor = MemoryReactorClock()
        site = stub_site(StubSettings(), reactor, StubLog(None))
        endpoint = TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1")
        return reactor, LoadingService(endpoint, site, reactor, load_time)

    def test_the_port_opens_only_after_the_load_time(self) -> None:
        reactor, service = self.service(1.5)
        service.privilegedStartService()
        service.startService()
        reactor.advance(1.4)
        self.assertEqual(reactor.tcpServers, [], "no port while the model loads")
        reactor.advance(0.1)
        self.assertEqual(len(reactor.tcpServers), 1)
        self.successResultOf(service.stopService())

    def test_a_stop_while_loading_never_opens_the_port(self) -> None:
        reactor, service = self.service(5)
        service.startService()
        self.successResultOf(service.stopService())
        self.assertFalse(service.running)
        reactor.advance(10)
        self.assertEqual(reactor.tcpServers, [])

    def test_the_option_defaults_to_no_load_time(self) -> None:
        options = Options()
        options.parseOptions([])
        self.assertEqual(options["load-time"], 0.0)
        options.parseOptions(["--load-time", "2.5"])
        self.assertEqual(options["load-time"], 2.5)
