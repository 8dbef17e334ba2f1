"""Server-side figures read from the router's Prometheus ``/metrics`` before and after a run.

Counters are summed over their label sets (e.g. over workers) and differenced, so the figures
cover this run only. A metric the server does not expose (or a server without ``/metrics``)
gives None, reported as n/a.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

PREFIX_HIT_TOKENS = "pdserve_prefix_hit_tokens_total"
PROMPT_TOKENS = "pdserve_prompt_tokens_total"
KV_TRANSFER_BYTES = "pdserve_kv_transfer_bytes_total"
KV_TRANSFER_SECONDS = "pdserve_kv_transfer_seconds_total"
METRIC_NAMES = (PREFIX_HIT_TOKENS, PROMPT_TOKENS, KV_TRANSFER_BYTES, KV_TRANSFER_SECONDS)

Snapshot = dict[str, float]  # metric sample name -> value summed over label sets


def parse_exposition(text: str) -> Snapshot:
    """The wanted counters in a text exposition, each summed over its label sets."""
    totals: Snapshot = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in METRIC_NAMES:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


async def scrape(http: httpx.AsyncClient, url: str) -> Snapshot:
    """Read ``url``; {} (logged, not raised) when the server has no usable metrics there."""
    try:
        response = await http.get(url)
    except httpx.HTTPError as err:
        logger.info("no server metrics: GET %s failed: %s: %s", url, type(err).__name__, err)
        return {}
    if response.status_code != 200:
        logger.info("no server metrics: GET %s returned HTTP %d", url, response.status_code)
        return {}
    try:
        return parse_exposition(response.text)
    except ValueError as err:
        logger.warning("server metrics at %s are not Prometheus text format: %s", url, err)
        return {}


@dataclass(slots=True, frozen=True)
class ServerFigures:
    """Counter increases over the run; None where the server does not report the metric."""

    prefix_hit_tokens: float | None = None
    prompt_tokens: float | None = None
    kv_transfer_bytes: float | None = None
    kv_transfer_s: float | None = None

    @property
    def prefix_hit_rate(self) -> float | None:
        """Fraction of prompt tokens whose KV came from the prefix cache."""
        if self.prefix_hit_tokens is None or not self.prompt_tokens:
            return None
        return self.prefix_hit_tokens / self.prompt_tokens

    @property
    def kv_transfer_bytes_per_s(self) -> float | None:
        """Bytes moved per second of transfer time (summed over concurrent transfers)."""
        if self.kv_transfer_bytes is None or not self.kv_transfer_s:
            return None
        return self.kv_transfer_bytes / self.kv_transfer_s


def figures(before: Snapshot, after: Snapshot) -> ServerFigures:
    """What the counters rose by between two snapshots."""

    def rise(name: str) -> float | None:
        if name not in before or name not in after:
            return None
        return after[name] - before[name]

    return ServerFigures(
        prefix_hit_tokens=rise(PREFIX_HIT_TOKENS),
        prompt_tokens=rise(PROMPT_TOKENS),
        kv_transfer_bytes=rise(KV_TRANSFER_BYTES),
        kv_transfer_s=rise(KV_TRANSFER_SECONDS),
    )
