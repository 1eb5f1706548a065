"""What happened to each request: Prometheus metrics and one structured log event.

Handlers fill one `RequestRecord` as the request moves (model, queue wait, first token, tokens,
stop reason, outcome) and `Telemetry.finish` turns it into counters, histograms and a single
`twisted.logger` event, and hands it to the usage ledger. The slot and queue gauges are read
from the limiters when scraped, so no code has to keep a second count in step with them.
Prompt and completion text never reach a record, nor does any key.

A client chooses the model name and the path, so neither may shape what is kept: metric labels
carry only configured model names (any other becomes `unknown`: a label set that grows with
every new name is memory and scrape size that never come back, and a name that is not valid
UTF-8 breaks every later scrape), and log fields are capped and escaped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from homelab_gateway.core.record import RequestRecord
from homelab_gateway.core.replicas import UP
from homelab_gateway.core.usage import charged, counted
from homelab_gateway.line.residency import Resident, boxes_status

if TYPE_CHECKING:
    from homelab_gateway.ledger import Ledger
    from homelab_gateway.line.pool import Pool
    from homelab_gateway.quotas import Quotas

WAIT_BUCKETS = (0.005, 0.05, 0.25, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120)
UNKNOWN_MODEL = "unknown"
LOGGED_CHARS = 200  # of each client-chosen string in a log line
RECENT = 50  # finished requests kept for the status page

request_log = Logger(namespace="homelab_gateway.requests")
OTHER_CLIENT = "other"
TOKEN_KINDS = ("input", "output", "cached")


class _SlotCollector(Collector):
    def __init__(
        self, pools: Mapping[str, Pool], label: Callable[[str], str], cluster: Any = None
    ) -> None:
        self._pools = pools
        self._label = label
        self._cluster = cluster

    def collect(self) -> Iterable[GaugeMetricFamily]:
        slots = GaugeMetricFamily("homelab_gateway_slots", "Configured slots", labels=["upstream"])
        in_use = GaugeMetricFamily(
            "homelab_gateway_slots_in_use", "Slots held", labels=["upstream"]
        )
        up = GaugeMetricFamily(
            "homelab_gateway_upstream_up",
            "1 while the upstream is in rotation, 0 while requests' failures keep it out",
            labels=["upstream"],
        )
        waiting = GaugeMetricFamily(
            "homelab_gateway_queue_waiting",
            "Requests waiting for a slot, per line (upstreams that serve a model together "
            "share one, named 'a+b')",
            labels=["upstream"],
        )
        by_class = GaugeMetricFamily(
            "homelab_gateway_queue_waiting_by_class",
            "Requests waiting for a slot, by the class they would be served as now",
            labels=["upstream", "class"],
        )
        by_client = GaugeMetricFamily(
            "homelab_gateway_queue_waiting_by_client",
            "Requests waiting for a slot, by client ([clients] names; any other as 'other')",
            labels=["upstream", "client"],
        )
        for name, pool in self._pools.items():
            slots.add_metric([name], pool.replica.limit)
            in_use.add_metric([name], pool.replica.held)
            up.add_metric([name], 1 if pool.replica.circuit.state == UP else 0)
        for line in dict.fromkeys(pool.line for pool in self._pools.values()):
            name = line.name
            waiting.add_metric([name], len(line.waiting))
            for cls, count in line.line.waiting_by_class(line.clock.seconds()).items():
                by_class.add_metric([name, cls], count)
            clients: dict[str, int] = {}
            for client, count in line.line.waiting_by_client().items():
                label = self._label(client)
                clients[label] = clients.get(label, 0) + count
            for label, count in clients.items():
                by_client.add_metric([name, label], count)
        families = [slots, in_use, up, waiting, by_class, by_client, *self._residency()]
        if self._cluster is not None:
            linked = GaugeMetricFamily(
                "homelab_gateway_cluster_up",
                "1 while the Redis the lines are shared through is reachable; 0: new requests "
                "get 529",
            )
            linked.add_metric([], 1 if self._cluster.live else 0)
            families.append(linked)
        return families

    def _residency(self) -> list[Any]:
        """Models loaded on demand: loads and unloads by upstream, the seconds loads took,
        which are resident, and each box's memory in use; nothing without managed upstreams."""
        residents = [p.resident for p in self._pools.values() if isinstance(p.resident, Resident)]
        if not residents:
            return []
        loads = CounterMetricFamily(
            "homelab_gateway_model_loads",
            "Loads of an upstream loaded on demand, begun (its server started or woken)",
            labels=["upstream"],
        )
        unloads = CounterMetricFamily(
            "homelab_gateway_model_unloads",
            "Unloads of an upstream loaded on demand, begun (idle, or its memory wanted)",
            labels=["upstream"],
        )
        seconds = SummaryMetricFamily(
            "homelab_gateway_model_load_seconds",
            "Seconds from a server's start until its health probe answered",
            labels=["upstream"],
        )
        resident = GaugeMetricFamily(
            "homelab_gateway_upstream_resident",
            "1 while an upstream loaded on demand is loaded, 0 otherwise",
            labels=["upstream"],
        )
        for r in residents:
            loads.add_metric([r.name], r.loads)
            unloads.add_metric([r.name], r.unloads)
            seconds.add_metric([r.name], r.loaded, r.load_seconds_total)
            resident.add_metric([r.name], 1 if r.state == "loaded" else 0)
        used = GaugeMetricFamily(
            "homelab_gateway_box_memory_used",
            "Memory of a box held by its models: loaded, loading or unloading",
            labels=["box"],
        )
        for box, entry in boxes_status(self._pools).items():
            used.add_metric([box], float(entry["used"]))  # type: ignore[arg-type]
        return [loads, unloads, seconds, resident, used]


class Telemetry:
    """Metrics and the request log, and what the status page reads: the requests being
    handled (`active`, by `id` of the record), the last `RECENT` finished ones with the
    moment each ended, and the tokens of those that held a slot (`token_totals`). All are
    kept in O(1) per request whether or not a page is open; `on_change`, if set, is told of
    every start and finish (the page's push).

    A metric's `client` label is a configured client's name (`clients`, the `[clients]`
    names, set again by a reload) or `other` for any caller else: an `[auth]` key, an
    address. So the label set is the config's, never the addresses that connect."""

    def __init__(
        self,
        clock: IReactorTime,
        pools: Mapping[str, Pool],
        cluster: Any = None,
        ledger: Ledger | None = None,
        quotas: Quotas | None = None,
        clients: Iterable[str] = (),
    ) -> None:
        self.clock = clock
        self.ledger = ledger  # where each finished request's usage is kept
        self.quotas = quotas  # and counted against its client's tokens_per_day
        self.clients = frozenset(clients)
        self.active: dict[int, RequestRecord] = {}
        self.recent: deque[tuple[RequestRecord, float]] = deque(maxlen=RECENT)
        self.on_change: Callable[[], None] | None = None
        self._input_tokens = self._output_tokens = 0  # of finished requests that held a slot
        # Each metric's child per label values: `labels()` checks and converts its arguments
        # and takes a lock on every call. Bounded as the metrics' own children are (labels are
        # configured names and fixed words, never a client's string), and never removed.
        self._children: dict[tuple[object, tuple[Any, ...]], Any] = {}
        self.registry = CollectorRegistry()
        self.registry.register(_SlotCollector(pools, self.client_label, cluster))
        self.requests = Counter(
            "homelab_gateway_requests",
            "Finished requests",
            ["upstream", "surface", "model", "outcome"],
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "homelab_gateway_queue_wait_seconds",
            "Time spent waiting for a slot",
            ["upstream"],
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self.class_queue_wait = Histogram(
            "homelab_gateway_queue_wait_by_class_seconds",
            "Time spent waiting for a slot, by the class the request was served as",
            ["upstream", "class"],
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self.client_service = Counter(
            "homelab_gateway_client_slot_seconds",
            "Slot time received (seconds a slot was held), by client",
            ["upstream", "client"],
            registry=self.registry,
        )
        self.client_tokens = Counter(
            "homelab_gateway_client_tokens",
            "Tokens by client and kind (input: the whole prompt, cached included; output; "
            "cached), counted as /llm/v1/usage counts them",
            ["client", "kind"],
            registry=self.registry,
        )
        self.first_token = Histogram(
            "homelab_gateway_time_to_first_token_seconds",
            "From sending the upstream request to the first token",
            ["upstream", "model"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.output_tokens = Counter(
            "homelab_gateway_output_tokens",
            "Tokens generated",
            ["upstream", "model"],
            registry=self.registry,
        )
        self.retries = Counter(
            "homelab_gateway_retries",
            "Requests sent again after a failed attempt, by the upstream that failed and why",
            ["upstream", "reason"],
            registry=self.registry,
        )
        self.failovers = Counter(
            "homelab_gateway_failovers",
            "Retries that could go to another replica, by the upstream that failed and why",
            ["upstream", "reason"],
            registry=self.registry,
        )
        self.cancellations = Counter(
            "homelab_gateway_upstream_cancellations",
            "Upstream requests the gateway cancelled (client gone, shutdown)",
            ["upstream"],
            registry=self.registry,
        )

    def client_label(self, client: str) -> str:
        return client if client in self.clients else OTHER_CLIENT

    def token_totals(self) -> tuple[int, int]:
        """Input and output tokens of every request that has held a slot since start, those
        in flight as far as they have come: the status page's tokens per second."""
        input_tokens, output_tokens = self._input_tokens, self._output_tokens
        for record in self.active.values():
            if record.queue_wait is not None:
                input_tokens += record.input_tokens or 0
                output_tokens += record.output_tokens or 0
        return input_tokens, output_tokens

    def _child(self, metric: Any, *values: Any) -> Any:
        child = self._children.get((metric, values))
        if child is None:
            child = self._children[metric, values] = metric.labels(*values)
        return child

    def retried(self, upstream: str, reason: str, elsewhere: bool) -> None:
        self._child(self.retries, upstream, reason).inc()
        if elsewhere:
            self._child(self.failovers, upstream, reason).inc()

    def start(self, request_id: str, surface: str, method: bytes, path: bytes) -> RequestRecord:
        record = RequestRecord(
            request_id=request_id,
            surface=surface,
            started=self.clock.seconds(),
            method=method.decode("latin-1"),
            path=path.decode("latin-1"),
        )
        self.active[id(record)] = record
        if self.on_change is not None:
            self.on_change()
        return record

    def finish(self, record: RequestRecord) -> None:
        self.active.pop(id(record), None)
        # A request for a model, or one that went through an upstream's slots: a plain route's
        # traffic (a NAS's web UI), 401s and stray paths would push the answers out of view.
        if record.served_model is not None or record.queue_wait is not None:
            self.recent.append((record, self.clock.seconds()))
        if self.on_change is not None:
            self.on_change()
        outcome = record.outcome or "completed"
        model_label = record.served_model or (UNKNOWN_MODEL if record.model else "")
        child = self._child
        child(self.requests, record.upstream, record.surface, model_label, outcome).inc()
        if record.queue_wait is not None and record.upstream:
            child(self.queue_wait, record.upstream).observe(record.queue_wait)
            served_as = record.served_as or record.priority
            child(self.class_queue_wait, record.upstream, served_as).observe(record.queue_wait)
        client = self.client_label(record.client)
        if record.slot_seconds is not None and record.upstream:
            child(self.client_service, record.upstream, client).inc(record.slot_seconds)
        if record.queue_wait is not None:
            self._input_tokens += record.input_tokens or 0
            self._output_tokens += record.output_tokens or 0
        if counted(record) and charged(record):
            counts = (record.input_tokens, record.output_tokens, record.cached_tokens)
            for kind, count in zip(TOKEN_KINDS, counts, strict=True):
                if count:
                    child(self.client_tokens, client, kind).inc(count)
        if record.first_token is not None:
            child(self.first_token, record.upstream, model_label).observe(record.first_token)
        if record.output_tokens:
            child(self.output_tokens, record.upstream, model_label).inc(record.output_tokens)
        if record.upstream_cancelled:
            child(self.cancellations, record.upstream).inc()
        if self.ledger is not None:
            self.ledger.add(record)
        if self.quotas is not None:
            self.quotas.add(record)
        method, path = loggable(record.method), loggable(record.path)
        model = loggable(record.model) if record.model else None
        stop_reason = loggable(record.stop_reason) if record.stop_reason else record.stop_reason
        fields: dict[str, Any] = {
            "request_id": record.request_id,
            "surface": record.surface,
            "method": method,
            "path": path,
            "model": model,
            "upstream": record.upstream or None,
            "stream": record.stream,
            "queue_wait": _round(record.queue_wait),
            "time_to_first_token": _round(record.first_token),
            "duration": _round(self.clock.seconds() - record.started),
            "input_tokens": record.input_tokens,
            "output_tokens": record.output_tokens,
            "stop_reason": stop_reason,
            "outcome": outcome,
            "status": record.status,
            "client": record.client or None,
            "priority": record.priority,
            "served_as": record.served_as,
        }
        # Rendered here with an f-string: twisted.logger's own formatting of a dozen named fields
        # costs more than the rest of a short request. Every field still travels with the event.
        summary = (
            f"{record.request_id} {method} {path} {model or '-'} -> "
            f"{_show(record.status)} {outcome} in {fields['duration']}s"
            f" (queue {_show(fields['queue_wait'], 's')},"
            f" first token {_show(fields['time_to_first_token'], 's')},"
            f" tokens {_show(record.input_tokens)}/{_show(record.output_tokens)})"
        )
        request_log.info("{summary}", summary=summary, **fields)


def loggable(text: str, limit: int = LOGGED_CHARS) -> str:
    """`text` safe for one line of a UTF-8 log: at most `limit` characters (then `...`), and
    anything unprintable (a newline that would forge a line, a lone surrogate UTF-8 cannot
    encode) as a backslash escape."""
    if len(text) <= limit and text.isprintable():
        return text
    cut = text[:limit]
    shown = "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in cut
    )
    return shown + ("..." if len(text) > limit else "")


def _show(value: object, unit: str = "") -> str:
    return "-" if value is None else f"{value}{unit}"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
