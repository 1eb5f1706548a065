"""The Grafana dashboard (etc/grafana/homelab-gateway.json) against what the gateway exports.

Every panel query is parsed as PromQL (promql-parser, after Grafana's own variable
substitution), and each metric it selects, each label it matches on, groups by or joins on,
must be in the real `/metrics` output of a gateway that has served, queued, and cancelled
requests. Names are compared as exported samples are named (a Counter `requests` is scraped as
`requests_total`, a Histogram as `_bucket`, `_sum` and `_count`), so a query that would find
nothing in Prometheus fails here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
from prometheus_client.parser import text_string_to_metric_families
from twisted.trial.unittest import TestCase

from tests.surfaces.test_proxy import async_test
from testsupport.helpers import Servers, chat, gateway_document, raw_request, wait_for

DASHBOARD = Path(__file__).parents[2] / "etc" / "grafana" / "homelab-gateway.json"
# What Grafana puts in place of its variables before Prometheus sees a query.
GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
    "$upstream": ".*",
}
LABEL_VALUES = re.compile(r"label_values\((\w+),\s*(\w+)\)")


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside (collapsed) rows included."""
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def queries() -> list[str]:
    return [
        target["expr"]
        for panel in panels(dashboard()["panels"])
        for target in panel.get("targets", [])
    ]


def interpolate(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a Grafana variable this test does not know: {expr}"
    return expr


def nodes(expr: Any) -> list[Any]:
    found: list[Any] = []
    promql_parser.walk(expr, found.append)
    return found


def selectors(expr: Any) -> list[Any]:
    return [node for node in nodes(expr) if isinstance(node, promql_parser.VectorSelector)]


class Exported:
    """Sample name -> the label names it is exported with, from scrapes of /metrics."""

    def __init__(self) -> None:
        self.labels: dict[str, set[str]] = {}

    def add(self, text: str) -> None:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.labels.setdefault(sample.name, set()).update(sample.labels)

    def problems(self, expr: str) -> list[str]:
        """What in one query names a metric or a label the gateway does not export."""
        out = []
        tree = promql_parser.parse(interpolate(expr))
        for selector in selectors(tree):
            name = selector.name
            if name not in self.labels:
                out.append(f"metric {name} is not exported")
                continue
            for matcher in selector.matchers.matchers:
                if matcher.name not in self.labels[name]:
                    out.append(f"{name} has no label {matcher.name}")
        for node in nodes(tree):
            if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
                out += self._grouping(node.modifier.labels, node.expr, "by/without")
            if isinstance(node, promql_parser.BinaryExpr):
                matching = node.modifier.matching if node.modifier is not None else None
                if matching is not None:
                    for side in (node.lhs, node.rhs):
                        out += self._grouping(matching.labels, side, "on/ignoring")
        return out

    def _grouping(self, labels: list[str], expr: Any, how: str) -> list[str]:
        """Labels grouped or joined on must be on some metric beneath: else a typo."""
        beneath: set[str] = set()
        for selector in selectors(expr):
            beneath |= self.labels.get(selector.name, set())
        return [
            f"{how} ({label}): no metric beneath has it" for label in labels if label not in beneath
        ]


class DashboardFile(TestCase):
    def test_importable_as_is_with_a_prometheus_input(self) -> None:
        document = dashboard()
        inputs = {i["name"]: i for i in document["__inputs"]}
        self.assertEqual(inputs["DS_PROMETHEUS"]["pluginId"], "prometheus")
        self.assertIsNone(document["id"])
        all_panels = list(panels(document["panels"]))
        ids = [panel["id"] for panel in all_panels]
        self.assertEqual(len(ids), len(set(ids)))
        for panel in all_panels:
            if panel["type"] == "row":
                continue
            self.assertEqual(panel["datasource"]["uid"], "${DS_PROMETHEUS}", panel["title"])
            self.assertTrue(panel["targets"], panel["title"])
            for target in panel["targets"]:
                self.assertEqual(target["datasource"]["uid"], "${DS_PROMETHEUS}")
        for variable in document["templating"]["list"]:
            self.assertEqual(variable["datasource"]["uid"], "${DS_PROMETHEUS}")

    def test_every_query_is_promql(self) -> None:
        self.assertGreater(len(queries()), 10)
        for expr in queries():
            promql_parser.parse(interpolate(expr))  # raises on a syntax error


class AgainstMetrics(TestCase):
    """A gateway that has granted, queued, completed and cancelled requests, scraped twice:
    while one request waits (the waiting gauges have samples then) and after."""

    maxDiff = None

    @async_test
    async def test_every_metric_and_label_the_dashboard_uses_is_exported(self) -> None:
        servers = Servers(self)
        stub_url, _, log = servers.stub(hold=0.3)
        document = gateway_document(stub_url, slots=1)
        # A replica that refuses, preferred to the stub: one retry and one failover to count.
        document["upstreams"]["down"] = {"url": "http://127.0.0.1:1/v1", "slots": 1}
        document["upstreams"]["spare"] = {"url": stub_url, "slots": 1, "fallback": True}
        document["models"]["both"] = {"upstreams": ["down", "spare"]}
        servers.start_gateway(document)
        port = servers.gateway_port
        assert servers.gateway is not None
        slots = servers.gateway.pools["vllm"].line
        exported = Exported()

        async def scrape() -> None:
            response = raw_request(port, "GET", "/metrics")
            await response.closed
            exported.add(response.body_text())

        first = raw_request(port, "POST", "/llm/v1/messages", chat())
        await wait_for(lambda: slots.in_use == 1, what="the slot to fill")
        queued = raw_request(port, "POST", "/llm/v1/messages", chat(), {"x-priority": "batch"})
        await wait_for(lambda: len(slots.waiting) == 1, what="one to queue")
        await scrape()
        await first.closed
        await queued.closed
        leaver = raw_request(port, "POST", "/llm/v1/messages", chat(content="long"))
        await wait_for(lambda: log.events("start")[2:], what="the third upstream request")
        leaver.disconnect()
        await wait_for(lambda: log.events("cancelled"), what="the cancel")
        await wait_for(lambda: slots.in_use == 0, what="the slot to free")
        retried = raw_request(port, "POST", "/llm/v1/messages", chat(model="both"))
        await retried.closed
        self.assertIn("message_stop", retried.body_text())
        await scrape()

        problems = {expr: exported.problems(expr) for expr in queries()}
        self.assertEqual({e: p for e, p in problems.items() if p}, {})
        for variable in dashboard()["templating"]["list"]:
            metric, label = LABEL_VALUES.fullmatch(variable["definition"]).groups()  # type: ignore[union-attr]
            self.assertIn(label, exported.labels.get(metric, set()), variable["definition"])

    def test_a_wrong_name_or_label_is_caught(self) -> None:
        exported = Exported()
        exported.add(
            "# TYPE homelab_gateway_requests counter\n"
            'homelab_gateway_requests_total{upstream="vllm",outcome="completed"} 1.0\n'
        )
        self.assertEqual(exported.problems("sum by (outcome) (homelab_gateway_requests_total)"), [])
        self.assertEqual(
            exported.problems("rate(homelab_gateway_requests[5m])"),
            ["metric homelab_gateway_requests is not exported"],
        )
        self.assertEqual(
            exported.problems('homelab_gateway_requests_total{model="x"}'),
            ["homelab_gateway_requests_total has no label model"],
        )
        self.assertEqual(
            exported.problems("sum by (status) (homelab_gateway_requests_total)"),
            ["by/without (status): no metric beneath has it"],
        )
