"""The /llm client encodes each upstream URL once and sends exactly what treq would, and
never keeps or sends a cookie."""

from __future__ import annotations

from typing import Any

import pytest
from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import HostnameEndpoint
from twisted.web.client import URI
from twisted.web.error import SchemeNotSupported
from twisted.web.http_headers import Headers

from homelab_gateway.upstream.client import EndpointPerHost, llm_http


class RecordingAgent:
    def __init__(self) -> None:
        self.uris: list[bytes] = []
        self.headers: list[Headers] = []

    def request(self, method: bytes, uri: bytes, headers: Any = None, body: Any = None) -> Any:
        self.uris.append(uri)
        self.headers.append(headers)
        return Deferred()


class CookieSettingAgent(RecordingAgent):
    """Answers every request at once with a `Set-Cookie` an ordinary jar would keep."""

    def request(self, method: bytes, uri: bytes, headers: Any = None, body: Any = None) -> Any:
        super().request(method, uri, headers, body)
        response = _Answer(Headers({b"set-cookie": [b"session=abc; Path=/"]}))
        return succeed(response)


class _Answer:
    code = 200
    phrase = b"OK"
    version = (b"HTTP", 1, 1)
    length = 0

    def __init__(self, headers: Headers) -> None:
        self.headers = headers


URLS = [
    "http://127.0.0.1:8000/v1/chat/completions",
    "http://gpu-box.lan:11434/v1/chat/completions",
    "https://bücher.example/v1/chat/completions",
    "http://box:8000/some path/ü/v1/tokenize?x=a b",
    "http://user:pw@box/v1%2Fx/chat/completions",
]


@pytest.mark.parametrize("url", URLS)
def test_the_same_uri_as_treq_on_every_request(url: str) -> None:
    ours, treqs = RecordingAgent(), RecordingAgent()
    client, plain = llm_http(ours), HTTPClient(treqs)  # type: ignore[arg-type]
    for _ in range(2):  # the first encodes, the second reuses
        client.request("POST", url, data=b"{}", unbuffered=True, allow_redirects=False)
        plain.request("POST", url, data=b"{}", unbuffered=True, allow_redirects=False)
    assert ours.uris == treqs.uris
    assert len(ours.uris) == 2


def test_one_endpoint_per_host_for_every_request() -> None:
    endpoints = EndpointPerHost(reactor, 10.0)
    first = endpoints.endpointForURI(URI.fromBytes(b"http://127.0.0.1:8000/v1/chat/completions"))
    assert isinstance(first, HostnameEndpoint)
    assert endpoints.endpointForURI(URI.fromBytes(b"http://127.0.0.1:8000/v1/tokenize")) is first
    other = endpoints.endpointForURI(URI.fromBytes(b"http://127.0.0.1:8001/v1/tokenize"))
    assert other is not first
    tls = endpoints.endpointForURI(URI.fromBytes(b"https://gpu.example:443/v1/models"))
    assert not isinstance(tls, HostnameEndpoint)  # TLS wrapped around the TCP endpoint
    with pytest.raises(SchemeNotSupported):
        endpoints.endpointForURI(URI.fromBytes(b"ftp://box/file"))


def test_no_cookie_is_kept_or_sent() -> None:
    agent = CookieSettingAgent()
    client = llm_http(agent)  # type: ignore[arg-type]
    url = "http://127.0.0.1:8000/v1/chat/completions"
    for _ in range(2):
        client.request("POST", url, data=b"{}", unbuffered=True, allow_redirects=False)
    assert [h.getRawHeaders(b"cookie") for h in agent.headers] == [None, None]
    assert list(client._cookiejar) == []  # type: ignore[attr-defined]
