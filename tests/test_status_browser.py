"""The status page in a real browser: Debian's headless chromium, driven by Playwright, against
the real daemon and the real stub, both run by twistd.

Playwright's sync API runs here in pytest's own thread: this module starts no reactor (the
daemon and the stub are child processes), so nothing competes with Playwright's event loop
and nothing is left on a reactor. Every wait is Playwright's own wait for a DOM state,
bounded by PATIENCE. `make test` installs chromium where it is missing; Playwright is never
asked to download a browser.

With STATUS_PAGE_SCREENSHOT=PATH set, the page under load is saved there (docs/status-page.png
is made this way).
"""

from __future__ import annotations

import json
import os
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import Locator, Page, expect, sync_playwright

from tests.helpers import PATIENCE
from tests.processes import Process, start_gateway, start_stub

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
KEYS = {"OPS_KEY": "ops-key-1", "FRONTEND_KEY": "fe-key-2", "CLAUDE_KEY": "cc-key-3"}
KEYS["NIGHTLY_KEY"] = "nightly-key-4"


def config(vllm: str, ollama: str) -> str:
    return f"""
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
def page(gateway: str) -> Iterator[Page]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            context.set_default_timeout(WAIT_MS)
            yield context.new_page()
        finally:
            browser.close()


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


def card(page: Page, upstream: str) -> Locator:
    return page.locator(f'[data-upstream="{upstream}"]')


def test_the_page_shows_slots_fill_a_line_form_and_both_empty_again(
    gateway: str, page: Page
) -> None:
    page.goto(gateway + "/")  # redirected to the page
    assert page.url == gateway + "/status"
    expect(page.locator("#key-form")).to_be_visible(timeout=WAIT_MS)  # protect_metrics
    page.fill("#key", "wrong")
    page.click("#key-form button[type=submit]")
    expect(page.locator("#key-message")).to_contain_text("not accepted", timeout=WAIT_MS)
    page.fill("#key", KEYS["OPS_KEY"])
    page.click("#key-form button[type=submit]")
    expect(page.locator("#connection")).to_have_attribute("data-state", "live", timeout=WAIT_MS)

    vllm = card(page, "vllm")
    bar = vllm.locator(".bar")
    expect(bar).to_have_attribute("aria-valuenow", "0", timeout=WAIT_MS)
    expect(bar).to_have_attribute("aria-valuemax", "2", timeout=WAIT_MS)
    expect(vllm.locator(".models")).to_have_text("reasoning, qwen-coder", timeout=WAIT_MS)

    for key, model in ((KEYS["FRONTEND_KEY"], "reasoning"), (KEYS["NIGHTLY_KEY"], "qwen-coder")):
        answer(gateway, key, model)
    expect(page.locator("#finished td", has_text="completed")).to_have_count(2, timeout=WAIT_MS)
    expect(bar).to_have_attribute("aria-valuenow", "0", timeout=WAIT_MS)

    held = [stream(gateway, KEYS["FRONTEND_KEY"], "reasoning")]
    expect(bar).to_have_attribute("aria-valuenow", "1", timeout=WAIT_MS)
    expect(bar).to_have_attribute("data-full", "false", timeout=WAIT_MS)
    page.wait_for_function(
        "() => Number(document.querySelector('#in-flight td.tokens')?.textContent) > 0",
        timeout=WAIT_MS,
    )
    held.append(stream(gateway, KEYS["CLAUDE_KEY"], "qwen-coder"))
    held.append(stream(gateway, KEYS["CLAUDE_KEY"], "qwen2.5:3b-instruct"))
    expect(bar).to_have_attribute("aria-valuenow", "2", timeout=WAIT_MS)
    expect(bar).to_have_attribute("data-full", "true", timeout=WAIT_MS)
    expect(card(page, "ollama").locator(".bar")).to_have_attribute(
        "aria-valuenow", "1", timeout=WAIT_MS
    )

    waiting = [
        stream(gateway, KEYS["NIGHTLY_KEY"], "reasoning"),
        stream(gateway, KEYS["NIGHTLY_KEY"], "reasoning"),
        stream(gateway, KEYS["NIGHTLY_KEY"], "qwen-coder"),
        stream(gateway, KEYS["CLAUDE_KEY"], "reasoning"),
        stream(gateway, KEYS["FRONTEND_KEY"], "reasoning"),
    ]
    expect(vllm.locator(".waiting")).to_have_text("5", timeout=WAIT_MS)
    expect(vllm.locator('[data-class="batch"] b')).to_have_text("3", timeout=WAIT_MS)
    expect(vllm.locator('[data-class="interactive"] b')).to_have_text("1", timeout=WAIT_MS)
    expect(vllm.locator('tr[data-client="nightly"] td.num')).to_have_text("3", timeout=WAIT_MS)
    expect(vllm.locator(".longest")).to_be_visible(timeout=WAIT_MS)
    expect(page.locator("#in-flight-count")).to_have_text("3", timeout=WAIT_MS)
    text = page.locator("body").inner_text()
    assert not any(key in text for key in KEYS.values())
    screenshot = os.environ.get("STATUS_PAGE_SCREENSHOT")
    if screenshot:
        page.screenshot(path=Path(screenshot), full_page=True)

    for connection in waiting + held:
        connection.close()
    expect(bar).to_have_attribute("aria-valuenow", "0", timeout=WAIT_MS)
    expect(vllm.locator(".waiting")).to_have_text("0", timeout=WAIT_MS)
    expect(card(page, "ollama").locator(".bar")).to_have_attribute(
        "aria-valuenow", "0", timeout=WAIT_MS
    )
    expect(page.locator("#in-flight-count")).to_have_text("0", timeout=WAIT_MS)
    expect(page.locator("#finished td", has_text="client_disconnected")).to_have_count(
        8, timeout=WAIT_MS
    )
