"""The status page in a real browser: Debian's headless chromium, driven by Playwright, against
the real daemon and the real stub, both run by twistd.

Playwright's sync API runs here in pytest's own thread: this module starts no reactor (the
daemon and the stub are child processes), so nothing competes with Playwright's event loop
and nothing is left on a reactor. Every wait is Playwright's own wait for a DOM state,
bounded by PATIENCE. `make test` installs chromium where it is missing; Playwright is never
asked to download a browser.

With STATUS_PAGE_SCREENSHOT=PATH set, the page under load is saved there (docs/status-page.png
is made this way), and with STATUS_PAGE_CHARTS_SCREENSHOT=PATH its charts, once the load is
gone (docs/status-page-charts.png).

The gateway samples every 0.2 s here, so the charts' hour is 72 s and a sample follows each
change at once: a wait for a chart's state is as short as a wait for a table's.
"""

from __future__ import annotations

import json
import os
import re
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import Browser, Locator, Page, Route, expect, sync_playwright

from testsupport.helpers import PATIENCE
from testsupport.processes import Process, start_gateway, start_stub

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",  # root in a container: chromium's sandbox needs user namespaces
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",  # a container's small /dev/shm crashes renderers
]
WAIT_MS = PATIENCE * 1000
expect.set_options(timeout=WAIT_MS)  # every wait for a DOM state below is bounded by PATIENCE
KEYS = {"OPS_KEY": "ops-key-1", "FRONTEND_KEY": "fe-key-2", "CLAUDE_KEY": "cc-key-3"}
KEYS["NIGHTLY_KEY"] = "nightly-key-4"
SAMPLE_INTERVAL = 0.2
# A line chart's points, as (when on the gateway's clock, value): the SVG holds x as seconds
# before the newest sample (its `data-newest`) and y as the value itself.
POINTS = """selector => {
  const line = document.querySelector(selector);
  if (!line || !line.ownerSVGElement.dataset.newest) return [];
  const newest = Number(line.ownerSVGElement.dataset.newest);
  return line.getAttribute("points").split(" ").filter(Boolean)
    .map(point => point.split(",").map(Number)).map(([x, y]) => [newest + x, y]);
}"""
LAST = f"""([selector, value]) => {{
  const points = ({POINTS})(selector);
  return points.length > 0 && points[points.length - 1][1] === value;
}}"""
# Tokens: the area under a tokens/s line, over the samples taken after `since`.
AREA = f"""([selector, since]) => {{
  const points = ({POINTS})(selector);
  let area = 0;
  for (let i = 1; i < points.length; i++) {{
    if (points[i][0] > since) area += points[i][1] * (points[i][0] - points[i - 1][0]);
  }}
  return area;
}}"""
SLOTS, WAITING = '#chart-slots [data-series="in_use"]', '#chart-slots [data-series="waiting"]'
OUTPUT = '#chart-output [data-series="output_per_s"]'


def config(vllm: str, ollama: str) -> str:
    return f"""
[server]
status_sample_interval = {SAMPLE_INTERVAL}

[auth]
api_keys_env = "OPS_KEY"
protect_metrics = true

[clients.frontend]
key_env = "FRONTEND_KEY"
priority = "interactive"

[clients.claude-code]
key_env = "CLAUDE_KEY"

[clients.nightly]
key_env = "NIGHTLY_KEY"
priority = "batch"

[upstreams.vllm]
url = "{vllm}"
slots = 2

[upstreams.ollama]
url = "{ollama}"
slots = 1

[models.reasoning]
upstream = "vllm"

[models.qwen-coder]
upstream = "vllm"

[models."qwen2.5:3b-instruct"]
upstream = "ollama"
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cwd = tmp_path_factory.mktemp("status-page")
    # 20 tokens a second: a `long` answer (2,000 tokens) holds its slot until it is dropped.
    vllm, vllm_url = start_stub(cwd, "--delay", "0.05")
    ollama, ollama_url = start_stub(cwd, "--delay", "0.05")
    processes: list[Process] = [vllm, ollama]
    try:
        daemon, url = start_gateway(cwd, config(vllm_url, ollama_url), env=KEYS)
        processes.append(daemon)
        yield url
    finally:
        for process in reversed(processes):
            process.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh tab (its own sessionStorage) for each test."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(WAIT_MS)
    try:
        yield context.new_page()
    finally:
        context.close()


def stream(url: str, key: str, model: str, content: str = "long") -> socket.socket:
    """A streaming request left open, never read: closing the socket is the client leaving."""
    address = urlsplit(url)
    body = json.dumps(
        {
            "model": model,
            "max_tokens": 4000,
            "stream": True,
            "messages": [{"role": "user", "content": content}],
        }
    ).encode()
    head = (
        f"POST /llm/v1/messages HTTP/1.1\r\nHost: {address.netloc}\r\n"
        f"Content-Type: application/json\r\nx-api-key: {key}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    connection = socket.create_connection((address.hostname, address.port), timeout=PATIENCE)
    connection.sendall(head.encode() + body)
    return connection


def answer(url: str, key: str, model: str) -> None:
    """A whole non-streaming answer (16 tokens)."""
    body = {"model": model, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
    request = urllib.request.Request(
        url + "/llm/v1/messages",
        json.dumps(body).encode(),
        {"content-type": "application/json", "x-api-key": key},
    )
    with urllib.request.urlopen(request, timeout=PATIENCE) as response:
        assert json.load(response)["stop_reason"] == "end_turn"


def chat_answer(url: str, key: str, model: str) -> None:
    """A whole answer through the OpenAI chat surface, in the same line."""
    body = {"model": model, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
    request = urllib.request.Request(
        url + "/llm/v1/chat/completions",
        json.dumps(body).encode(),
        {"content-type": "application/json", "authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(request, timeout=PATIENCE) as response:
        assert json.load(response)["choices"][0]["finish_reason"] == "stop"


def card(page: Page, upstream: str) -> Locator:
    return page.locator(f'[data-upstream="{upstream}"]')


def until_last(page: Page, selector: str, value: float) -> None:
    """Wait for a line chart's newest point to be `value`."""
    page.wait_for_function(LAST, arg=[selector, value])


def usage(url: str) -> dict[str, int]:
    """/llm/v1/usage's tokens (input and output) by client."""
    request = urllib.request.Request(
        url + "/llm/v1/usage?by=client", headers={"x-api-key": KEYS["OPS_KEY"]}
    )
    with urllib.request.urlopen(request, timeout=PATIENCE) as response:
        rows = json.load(response)["rows"]
    return {row["client"]: row["input_tokens"] + row["output_tokens"] for row in rows}


def test_the_page_shows_slots_fill_a_line_form_and_both_empty_again_and_charts_them(
    gateway: str, page: Page
) -> None:
    page.goto(gateway + "/")  # redirected to the page
    assert page.url == gateway + "/status"
    expect(page.locator("#key-form")).to_be_visible()  # protect_metrics
    page.fill("#key", "wrong")
    page.click("#key-form button[type=submit]")
    expect(page.locator("#key-message")).to_contain_text("not accepted")
    page.fill("#key", KEYS["OPS_KEY"])
    page.click("#key-form button[type=submit]")
    expect(page.locator("#connection")).to_have_attribute("data-state", "live")

    vllm = card(page, "vllm")
    bar = vllm.locator(".bar")
    expect(bar).to_have_attribute("aria-valuenow", "0")
    expect(bar).to_have_attribute("aria-valuemax", "2")
    expect(vllm.locator(".models")).to_have_text("reasoning, qwen-coder")
    until_last(page, '#chart-slots [data-series="slots"]', 3)  # vllm's 2 and ollama's 1
    until_last(page, OUTPUT, 0)  # nothing generates: what follows is the answers' alone
    since = float(page.locator("#chart-output svg").get_attribute("data-newest") or "nan")

    answer(gateway, KEYS["FRONTEND_KEY"], "reasoning")
    chat_answer(gateway, KEYS["NIGHTLY_KEY"], "qwen-coder")
    expect(page.locator("#finished td", has_text="completed")).to_have_count(2)
    # 16 tokens each: the area under the output tokens/s line, once both are sampled.
    page.wait_for_function(f"args => ({AREA})(args) > 31", arg=[OUTPUT, since])
    assert abs(page.evaluate(AREA, [OUTPUT, since]) - 32) < 0.1
    for surface in ("messages", "chat"):  # each request's surface, beside its model
        cells = page.locator("#finished td").filter(has_text=re.compile(f"^{surface}$"))
        expect(cells).to_have_count(1)
    expect(bar).to_have_attribute("aria-valuenow", "0")

    held = [stream(gateway, KEYS["FRONTEND_KEY"], "reasoning")]
    expect(bar).to_have_attribute("aria-valuenow", "1")
    expect(bar).to_have_attribute("data-full", "false")
    page.wait_for_function(
        "() => Number(document.querySelector('#in-flight td.tokens')?.textContent) > 0"
    )
    held.append(stream(gateway, KEYS["CLAUDE_KEY"], "qwen-coder"))
    held.append(stream(gateway, KEYS["CLAUDE_KEY"], "qwen2.5:3b-instruct"))
    expect(bar).to_have_attribute("aria-valuenow", "2")
    expect(bar).to_have_attribute("data-full", "true")
    expect(card(page, "ollama").locator(".bar")).to_have_attribute("aria-valuenow", "1")

    waiting = [
        stream(gateway, KEYS["NIGHTLY_KEY"], "reasoning"),
        stream(gateway, KEYS["NIGHTLY_KEY"], "reasoning"),
        stream(gateway, KEYS["NIGHTLY_KEY"], "qwen-coder"),
        stream(gateway, KEYS["CLAUDE_KEY"], "reasoning"),
        stream(gateway, KEYS["FRONTEND_KEY"], "reasoning"),
    ]
    expect(vllm.locator(".waiting")).to_have_text("5")
    expect(vllm.locator('[data-class="batch"] b')).to_have_text("3")
    expect(vllm.locator('[data-class="interactive"] b')).to_have_text("1")
    expect(vllm.locator('tr[data-client="nightly"] td.num')).to_have_text("3")
    expect(vllm.locator(".longest")).to_be_visible()
    expect(page.locator("#in-flight-count")).to_have_text("3")
    until_last(page, SLOTS, 3)
    until_last(page, WAITING, 5)
    page.wait_for_function(f"() => ({POINTS})('{OUTPUT}').some(([, y]) => y > 0)")
    text = page.locator("body").inner_text()
    assert not any(key in text for key in KEYS.values())
    screenshot = os.environ.get("STATUS_PAGE_SCREENSHOT")
    if screenshot:
        page.screenshot(path=Path(screenshot), full_page=True)

    for connection in waiting + held:
        connection.close()
    expect(bar).to_have_attribute("aria-valuenow", "0")
    expect(vllm.locator(".waiting")).to_have_text("0")
    expect(card(page, "ollama").locator(".bar")).to_have_attribute("aria-valuenow", "0")
    expect(page.locator("#in-flight-count")).to_have_text("0")
    expect(page.locator("#finished td", has_text="client_disconnected")).to_have_count(8)
    until_last(page, SLOTS, 0)
    until_last(page, WAITING, 0)

    # A page opened now has the hour before it, and the days as the ledger counts them.
    page.reload()
    expect(page.locator("#connection")).to_have_attribute("data-state", "live")
    until_last(page, SLOTS, 0)
    held = page.evaluate(POINTS, SLOTS)
    assert max(y for _, y in held) == 3
    assert held[0][0] <= since, "the history is older than the page"
    assert max(y for _, y in page.evaluate(POINTS, WAITING)) == 5
    counted = usage(gateway)
    assert set(counted) == {"frontend", "claude-code", "nightly"}
    for client, tokens in counted.items():
        bars = page.locator(f'#chart-days rect[data-client="{client}"]')
        expect(bars).to_have_count(1)  # today's
        expect(bars).to_have_attribute("data-tokens", str(tokens))
    expect(page.locator("#chart-days .legend")).to_contain_text("frontend")
    screenshot = os.environ.get("STATUS_PAGE_CHARTS_SCREENSHOT")
    if screenshot:
        page.locator("#charts").screenshot(path=Path(screenshot))


def test_health_and_a_models_line_are_shown_where_the_gateway_says_and_names_stay_text(
    gateway: str, page: Page
) -> None:
    """Fields /llm/v1/status does not have yet (an upstream's health, a line per model) are
    drawn when a snapshot has them; a name is never markup. The stream is held off so that
    only the snapshot given here is drawn."""

    def refuse(route: Route) -> None:
        route.abort()

    page.route("**/status/events", refuse)
    page.goto(gateway + "/status")
    expect(page.locator("#connection")).to_have_attribute("data-state", "reconnecting")
    trap = '<img src=x onerror="document.title=1">'
    line = {"waiting": 2, "waiting_by_client": [{"client": trap, "count": 2}]}
    page.evaluate(
        """snapshot => render(snapshot)""",
        {
            "version": "9.9.9",
            "now": 1000.0,
            "uptime_s": 90061,
            "upstreams": {
                "box-a": {
                    "slots": 4,
                    "in_use": 1,
                    "health": "down",
                    "down_since": 990.0,
                    "last_error": "connection refused",
                    "models": ["reasoning"],
                    **line,
                },
                "box-b": {"slots": 4, "in_use": 0, "health": "half-open", "waiting": 0},
            },
            "models": {"reasoning": line},
            "clients": {
                "nightly": {"max_in_flight": 2, "in_flight": {"box-a+box-b": 1}},
                trap: {"tokens_per_day": 200000, "tokens_used": 1234},
            },
            "in_flight": [],
            "in_flight_total": 0,
            "finished": [],
        },
    )
    box = card(page, "box-a")
    expect(box.locator(".health")).to_have_attribute("data-health", "down")
    expect(box.locator(".health-detail")).to_contain_text("connection refused")
    expect(card(page, "box-b").locator(".health")).to_have_text("half-open")
    expect(page.locator("#model-section")).to_be_visible()
    expect(page.locator('[data-model="reasoning"] .waiting')).to_have_text("2")
    expect(page.locator("#uptime")).to_have_text("1d 1h")
    expect(page.locator('#clients tr[data-client="nightly"] .held')).to_have_text("1")
    expect(page.locator("#clients tbody tr").nth(1).locator(".used")).to_have_text("1234")
    expect(box.locator("td", has_text=trap)).to_have_count(1)  # the name, as text
    assert page.locator("img").count() == 0
    assert page.title() != "1"


def test_the_slots_legend_is_live_and_a_rate_says_when_its_sample_was_taken(
    gateway: str, page: Page
) -> None:
    """The newest sample was taken while both slots were busy; every request has finished
    since: the legend says 0 in use, not the sample's 2. In a cluster, the days are this
    gateway's own. The stream is held off so that only what is given here is drawn."""
    page.route("**/status/events", lambda route: route.abort())
    page.goto(gateway + "/status")
    expect(page.locator("#connection")).to_have_attribute("data-state", "reconnecting")
    expect(page.locator("#days-note")).to_be_hidden()
    upstream = {"slots": 2, "line": "box", "waiting": 0, "models": ["reasoning"]}
    snapshot = {
        "version": "9.9.9",
        "now": 1000.0,
        "uptime_s": 60,
        "upstreams": {"box": {**upstream, "in_use": 0}},
        "cluster": {"instance": "gw-1", "redis": "up"},
        "in_flight": [],
        "in_flight_total": 0,
        "finished": [],
    }
    history = {
        "interval": 10,
        "size": 360,
        "fields": ["at", "slots", "in_use", "waiting", "input_per_s", "output_per_s"],
        "samples": [[990.0, 2, 2, 3, 40.0, 12.0]],
    }
    page.evaluate("([s, h]) => { render(s); receiveHistory(h); }", [snapshot, history])
    legend = page.locator("#chart-slots .legend")
    expect(legend).to_contain_text("in use 0 / 2")
    expect(legend).to_contain_text("waiting 0")
    expect(page.locator("#chart-output .legend")).to_contain_text("sample at ")
    expect(page.locator("#chart-output .legend")).to_contain_text("12")
    expect(page.locator("#chart-input .legend")).to_contain_text("sample at ")
    expect(page.locator("#days-note")).to_contain_text("this gateway (gw-1) only")
    snapshot["upstreams"] = {"box": {**upstream, "in_use": 1}}
    page.evaluate("s => render(s)", snapshot)  # a request started: no sample since
    expect(legend).to_contain_text("in use 1 / 2")
