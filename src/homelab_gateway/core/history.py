"""The status page's charts as plain data (sans-IO): the last hour, sampled, and tokens by day.

Every `[server] status_sample_interval` seconds (10 by default) the gateway takes one sample:
its slots, those in use and the requests waiting at that moment (as a Prometheus scrape reads
a gauge), and the input and output tokens per second since the previous sample. `History`
keeps the last `SIZE` of them in a ring: 360, the last hour at 10 s, about a point per pixel
of a chart. Its memory and the page's first frame (~14 KB) stay that size however long the
gateway runs, and a sample costs a few sums and one pass over the requests being handled, so
it is taken whether or not a page is open: a page opened later shows the hour before it.

`tokens_by_day` turns the usage ledger's tokens by client and hour into the last `DAYS` days
(UTC, as `/llm/v1/usage` counts its hours) for the `TOP_CLIENTS` clients with the most tokens,
then one row for the rest.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from homelab_gateway.core.snapshot import TOP_CLIENTS

INTERVAL = 10.0  # [server] status_sample_interval's default
SIZE = 360
DAY = 86400
DAYS = 14
FIELDS = ("at", "slots", "in_use", "waiting", "input_per_s", "output_per_s")
"""What a sample's row lists, in order: the page reads them by these names."""
RATE_DIGITS = 2


@dataclass(frozen=True, slots=True)
class Sample:
    at: float  # when it was taken, on the gateway's clock
    slots: int
    in_use: int
    waiting: int
    input_per_s: float  # since the previous sample
    output_per_s: float

    def row(self) -> list[float]:
        """The sample as a JSON row in `FIELDS`' order: a list, not an object, since the
        first frame carries up to `SIZE` of them."""
        return [
            round(self.at, 3),
            self.slots,
            self.in_use,
            self.waiting,
            self.input_per_s,
            self.output_per_s,
        ]


class History:
    """The last `size` samples. Tokens come in as running totals (every token counted since
    start, those of requests still generating included), so a sample's rate is the growth
    since the previous one over the seconds between them, whatever the timer's delays."""

    def __init__(self, size: int = SIZE) -> None:
        self.samples: deque[Sample] = deque(maxlen=size)
        self._last: tuple[float, int, int] | None = None  # when, input total, output total

    def take(
        self,
        now: float,
        *,
        slots: int,
        in_use: int,
        waiting: int,
        input_tokens: int,
        output_tokens: int,
    ) -> Sample:
        """Add the sample at `now`. A total that shrank (an upstream's final count below the
        gateway's running estimate) counts as no tokens, not as a negative rate."""
        input_rate = output_rate = 0.0
        if self._last is not None:
            at, input_before, output_before = self._last
            seconds = now - at
            if seconds > 0:
                input_rate = round(max(0, input_tokens - input_before) / seconds, RATE_DIGITS)
                output_rate = round(max(0, output_tokens - output_before) / seconds, RATE_DIGITS)
        self._last = (now, input_tokens, output_tokens)
        sample = Sample(now, slots, in_use, waiting, input_rate, output_rate)
        self.samples.append(sample)
        return sample

    def document(self, interval: float) -> dict[str, Any]:
        """Every sample, for a page that has none yet: `interval` and the ring's size tell it
        how wide its hour is."""
        return {
            "interval": interval,
            "size": self.samples.maxlen,
            "fields": FIELDS,
            "samples": [sample.row() for sample in self.samples],
        }


def first_day(now: float, days: int = DAYS) -> int:
    """The start (unix seconds, UTC) of the first of the `days` days that end with today's."""
    return int(now // DAY) * DAY - (days - 1) * DAY


def tokens_by_day(
    rows: Iterable[tuple[str, int, int, int]],
    now: float,
    *,
    days: int = DAYS,
    top: int = TOP_CLIENTS,
) -> dict[str, Any]:
    """The per-day chart from (client, hour, input tokens, output tokens) rows: each client's
    tokens on each of the `days` days up to `now`'s, the `top` clients with the most tokens
    first (ties by name), then `{"others": k, ...}` summing the other k. Rows outside the
    days are left out."""
    first = first_day(now, days)
    sums: dict[str, tuple[list[int], list[int]]] = {}
    for client, hour, input_tokens, output_tokens in rows:
        day = (hour - first) // DAY
        if 0 <= day < days:
            inputs, outputs = sums.setdefault(client, ([0] * days, [0] * days))
            inputs[day] += input_tokens
            outputs[day] += output_tokens
    ranked = sorted(sums.items(), key=lambda item: (-sum(item[1][0]) - sum(item[1][1]), item[0]))
    clients: list[dict[str, Any]] = [
        {"client": client, "input_tokens": inputs, "output_tokens": outputs}
        for client, (inputs, outputs) in ranked[:top]
    ]
    rest = ranked[top:]
    if rest:
        clients.append(
            {
                "others": len(rest),
                "input_tokens": [sum(day) for day in zip(*(i for _, (i, _) in rest), strict=True)],
                "output_tokens": [sum(day) for day in zip(*(o for _, (_, o) in rest), strict=True)],
            }
        )
    return {
        "days": [
            datetime.fromtimestamp(first + day * DAY, UTC).date().isoformat() for day in range(days)
        ],
        "clients": clients,
    }
