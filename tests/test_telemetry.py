"""Metrics by client: configured clients by name, every other caller as one `other` label, and
tokens counted as the usage ledger counts them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from twisted.internet.task import Clock

from homelab_gateway.core.replicas import UP
from homelab_gateway.telemetry import Telemetry

CALLERS = ("frontend", "key-0a1b2c3d", "192.168.1.20", "fe80::1", "unknown", "")


def finish(telemetry: Telemetry, client: str, **fields: Any) -> None:
    record = telemetry.start("req_1", "messages", b"POST", b"/llm/v1/messages")
    record.client = client
    values = {
        "served_model": "reasoning",
        "upstream": "vllm",
        "queue_wait": 0.0,
        "slot_seconds": 2.0,
        "input_tokens": 100,
        "cached_tokens": 60,
        "output_tokens": 20,
    }
    for name, value in {**values, **fields}.items():
        setattr(record, name, value)
    telemetry.finish(record)


def labels(telemetry: Telemetry, metric: str) -> dict[tuple[str, ...], float]:
    """Each sample of `metric`: its label values (sorted by label name) -> value."""
    return {
        tuple(value for _, value in sorted(sample.labels.items())): sample.value
        for family in telemetry.registry.collect()
        for sample in family.samples
        if sample.name == metric
    }


def test_tokens_and_slot_seconds_by_client_have_the_configured_names_and_other() -> None:
    telemetry = Telemetry(Clock(), {}, clients={"frontend", "nightly"})
    for client in CALLERS:
        finish(telemetry, client)
    finish(telemetry, "frontend", output_tokens=5, cached_tokens=None)
    others = len(CALLERS) - 1
    assert labels(telemetry, "homelab_gateway_client_tokens_total") == {
        ("frontend", "input"): 200,
        ("frontend", "output"): 25,
        ("frontend", "cached"): 60,
        ("other", "input"): 100 * others,
        ("other", "output"): 20 * others,
        ("other", "cached"): 60 * others,
    }
    assert labels(telemetry, "homelab_gateway_client_slot_seconds_total") == {
        ("frontend", "vllm"): 4.0,
        ("other", "vllm"): 2.0 * others,
    }


def test_tokens_are_counted_where_the_ledger_counts_them() -> None:
    telemetry = Telemetry(Clock(), {}, clients={"frontend"})
    finish(telemetry, "frontend", served_model=None)  # refused before it named a model
    record = telemetry.start("req_2", "count_tokens", b"POST", b"/llm/v1/messages/count_tokens")
    record.client, record.served_model, record.input_tokens = "frontend", "reasoning", 50
    telemetry.finish(record)
    assert labels(telemetry, "homelab_gateway_client_tokens_total") == {}


def test_a_reload_names_a_new_client_and_what_was_counted_stays() -> None:
    telemetry = Telemetry(Clock(), {}, clients={"frontend"})
    finish(telemetry, "batch-box")
    telemetry.clients = frozenset({"frontend", "batch-box"})
    finish(telemetry, "batch-box")
    tokens = labels(telemetry, "homelab_gateway_client_tokens_total")
    assert (tokens[("batch-box", "output")], tokens[("other", "output")]) == (20, 20)


class Line:
    """What the collector reads of an upstream's line: its name, waiters and their clients."""

    name = "vllm"

    def __init__(self, clock: Clock, by_client: dict[str, int]) -> None:
        self.clock = clock
        self.waiting = [None] * sum(by_client.values())
        self.line = SimpleNamespace(
            waiting_by_class=lambda now: {}, waiting_by_client=lambda: by_client
        )


def test_waiting_by_client_has_the_same_labels() -> None:
    clock = Clock()
    line = Line(clock, {"frontend": 2, "key-0a1b2c3d": 1, "10.0.0.7": 3, "10.0.0.8": 1})
    replica = SimpleNamespace(limit=2, held=2, circuit=SimpleNamespace(state=UP))
    pools: Any = {"vllm": SimpleNamespace(line=line, replica=replica, resident=None)}
    telemetry = Telemetry(clock, pools, clients={"frontend"})
    assert labels(telemetry, "homelab_gateway_queue_waiting_by_client") == {
        ("frontend", "vllm"): 2,
        ("other", "vllm"): 5,
    }


def test_token_totals_count_requests_that_held_a_slot_as_far_as_they_have_come() -> None:
    telemetry = Telemetry(Clock(), {})
    finish(telemetry, "frontend")
    finish(telemetry, "frontend", queue_wait=None)  # never held a slot: refused in the line
    generating = telemetry.start("req_3", "messages", b"POST", b"/llm/v1/messages")
    generating.queue_wait, generating.input_tokens, generating.output_tokens = 0.5, 40, 7
    waiting = telemetry.start("req_4", "messages", b"POST", b"/llm/v1/messages")
    waiting.input_tokens = 900  # the estimate, before it has a slot
    assert telemetry.token_totals() == (140, 27)
    generating.output_tokens = 9
    telemetry.finish(generating)
    assert telemetry.token_totals() == (140, 29)
