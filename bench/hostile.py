"""What a hostile or careless client costs a real `twistd` gateway: its RSS and descriptors.

`python -m bench.hostile [TWISTD]` starts the stub and a gateway (from TWISTD, default this
venv's, so an older install can be measured beside it) and measures three things a client can
do that a gateway must bound:

- 100 requests, one after another, each with a 2 MB `metadata.user_id` (a session key of the
  client's size): the gateway's RSS before and after;
- 60 count_tokens at once, 1.2 MB each, while the upstream's `/tokenize` takes 40 s (a slow
  tokenizer here, in this process): the RSS while they wait;
- 2,000 `/status/events` subscribers that never read: the descriptors and RSS they hold.

Memory is not at the mercy of the machine's load as CPU is; each run still moves by a few MB.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import testsupport.processes as processes

TOKENIZE_DELAY = 40.0


class SlowTokenizer(http.server.BaseHTTPRequestHandler):
    """An upstream whose /tokenize answers after TOKENIZE_DELAY seconds."""

    def log_message(self, *args: Any) -> None:
        """Quiet."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        time.sleep(TOKENIZE_DELAY)
        self.answer(b'{"count": 7, "max_model_len": 100}')

    def do_GET(self) -> None:
        self.answer(b'{"data": []}')

    def answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def post(url: str, body: Any) -> int:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:  # the gateway stopped under a count still waiting
        return 0


def main() -> None:
    if len(sys.argv) > 1:
        processes.TWISTD = sys.argv[1]
    workdir = Path(tempfile.mkdtemp(prefix="hg-hostile-"))
    slow = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowTokenizer)
    threading.Thread(target=slow.serve_forever, daemon=True).start()
    stub, stub_url = processes.start_stub(workdir, "--content-tokens", "4")
    (workdir / "gateway").mkdir()
    config = f"""
[upstreams.vllm]
url = "{stub_url}"
slots = 2

[upstreams.slow]
url = "http://127.0.0.1:{slow.server_address[1]}/v1"
slots = 2

[models.fast]
upstream = "vllm"

[models.counted]
upstream = "slow"
"""
    gateway, url = processes.start_gateway(workdir / "gateway", config)
    pid = gateway.popen.pid

    def rss() -> float:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def descriptors() -> int:
        return len(os.listdir(f"/proc/{pid}/fd"))

    try:
        before = rss()
        for i in range(100):
            user = {"user_id": f"{i}-" + "u" * 2_000_000}
            message = [{"role": "user", "content": "hi"}]
            body = {"model": "fast", "max_tokens": 4, "messages": message, "metadata": user}
            assert post(url + "/llm/v1/messages", body) == 200
        print(f"100 requests with 2 MB user ids: RSS {before:.0f} -> {rss():.0f} MB")

        history = [{"role": ("user", "assistant")[i % 2], "content": "a"} for i in range(33_001)]
        count = {"model": "counted", "messages": history}
        before = rss()
        for _ in range(60):
            threading.Thread(
                target=post, args=(url + "/llm/v1/messages/count_tokens", count), daemon=True
            ).start()
        time.sleep(15)  # well within TOKENIZE_DELAY: all still waiting
        size = len(json.dumps(count)) / 1e6
        print(f"60 count_tokens of {size:.1f} MB waiting: RSS {before:.0f} -> {rss():.0f} MB")

        before_fds, before = descriptors(), rss()
        port = int(url.rsplit(":", 1)[1])
        watchers = []
        for _ in range(2000):
            watcher = socket.create_connection(("127.0.0.1", port))
            watcher.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            watcher.sendall(b"GET /status/events HTTP/1.1\r\nHost: gateway\r\n\r\n")
            watchers.append(watcher)
        time.sleep(5)
        print(
            f"2,000 status subscribers that never read: descriptors {before_fds} -> "
            f"{descriptors()}, RSS {before:.0f} -> {rss():.0f} MB"
        )
        for watcher in watchers:
            watcher.close()
    finally:
        gateway.popen.kill()
        stub.popen.kill()
        slow.shutdown()


if __name__ == "__main__":
    main()
