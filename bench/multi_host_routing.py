"""Routing over links of different speeds: the same router, link-aware and blind to links.

Four hosts (network namespaces on one bridge, ``pdserve.bench.netns_hosts``; needs root),
started with the commands a user runs, KV over the TCP backend, the real model in fp32:

    head   `pdserve up --head`: Redis, Ray head and the link-aware router (the default)
           `pdserve router --no-link-aware` beside it: the same policy, blind to links
    pf     `pdserve join --prefill 1`
    dc1g   `pdserve join --decode 1`, its link limited to 1 Gbit/s (tc tbf on its veth)
    dc10g  `pdserve join --decode 1`, its link limited to 10 Gbit/s

Each request is a distinct ``--prompt-tokens`` prompt of real text (``bench/data``; a
numbered header first, so no two share a cached block) with ``--max-tokens`` greedy tokens,
sent one at a time from this namespace to one of the two routers over gRPC. The first token
comes from the prefill worker (TTFT); the second from the decode worker, after the prompt's
KV crossed its link: the time from the first to the second token shows the link. fp32
SmolLM2 KV is 46,080 bytes a token (94 MB for 2,048 tokens: ~0.75 s at 1 Gbit/s).

Each router first serves ``--warmup`` requests (not counted): the link-aware one learns the
links from the prefill worker's transfer reports (a link not measured yet is assumed fast,
so it tries each). Then ``--requests`` requests each, in the order aware, blind, blind,
aware, ... so that a machine getting busier or quieter weighs on both alike.

    sudo .venv/bin/python -m pdserve.bench.multi_host --routing [--requests 16]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.kv_peer_fetch import PromptTexts
from pdserve.bench.netns_cluster import ENV, PDSERVE, join, joined, start_head
from pdserve.bench.netns_hosts import Lan, lan, skip_reason
from pdserve.bench.workload import default_model_file, load_tokenize
from pdserve.proto import common_pb2, inference_pb2, inference_pb2_grpc

# tc rate -> its token bucket: 1 ms of traffic (tbf needs a bucket of at least one timer
# tick's worth to reach a high rate).
LINKS = {"dc1g": ("1gbit", "1000kbit"), "dc10g": ("10gbit", "10000kbit")}
HOSTS = ("head", "pf", *LINKS)
BLIND_GRPC_PORT, BLIND_HTTP_PORT = 50_061, 8_061
CONFIGS = ("link-aware", "link-blind")


@dataclass(slots=True, frozen=True)
class RoutingSettings:
    prompt_tokens: int = 2048
    max_tokens: int = 16
    requests: int = 16  # measured, per router
    warmup: int = 2  # per router, not counted
    num_blocks: int = 384  # per worker


@dataclass(slots=True, frozen=True)
class Served:
    config: str
    decode_worker: str
    ttft_s: float
    second_s: float  # first token -> second token


@dataclass(slots=True, frozen=True)
class RoutingRun:
    settings: RoutingSettings
    served: tuple[Served, ...]
    link_rates: dict[str, float]  # the link-aware router's measured rates, by decode worker


# -- the cluster -------------------------------------------------------------------------


def routing_cluster(net: Lan, directory: Path, num_blocks: int) -> dict[str, str]:
    """Start the cluster on ``net`` (``lan`` stops it); each configuration's router gRPC
    address, and the aware router's /metrics URL under "metrics"."""
    blocks = ("--num-blocks", str(num_blocks))
    state = start_head(net, directory, *blocks)
    for name, role in (("pf", "--prefill"), ("dc1g", "--decode"), ("dc10g", "--decode")):
        join(net, directory, state, name, role, "1", *blocks)
    net.hosts["head"].popen((*PDSERVE, "router", "--no-link-aware", "--grpc-port",
                             str(BLIND_GRPC_PORT), "--http-port", str(BLIND_HTTP_PORT),
                             "--redis-url", state["redis_url"], "--key-prefix",
                             state["key_prefix"], "--cluster-secret-file", state["secret_file"]),
                            ENV, directory / "blind-router.log")  # fmt: skip
    joined(directory, ("pf", *LINKS))
    for name, (rate, burst) in LINKS.items():
        net.hosts[name].limit_inbound(rate, burst)
    return {
        "link-aware": state["grpc"],
        "link-blind": f"{net.hosts['head'].address}:{BLIND_GRPC_PORT}",
        "metrics": state["metrics"],
    }


# -- requests ----------------------------------------------------------------------------


def timed_generate(stub: Any, prompt: Sequence[int], max_tokens: int) -> tuple[str, float, float]:
    """(decode worker, TTFT, first -> second token) of one greedy request."""
    params = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = inference_pb2.GenerateTextRequest(params=params)
    request.token_ids.ids.extend(prompt)
    sent_s = time.perf_counter()
    arrivals: list[float] = []
    decode = ""
    for response in stub.Generate(request, timeout=300):
        now_s = time.perf_counter()
        arrivals += [now_s] * len(response.chunk.token_ids)
        decode = response.decode_worker or decode
    assert len(arrivals) == max_tokens >= 2, f"{len(arrivals)} tokens of {max_tokens}"
    return decode, arrivals[0] - sent_s, arrivals[1] - arrivals[0]


def _wait_serving(stub: Any, prompt: Sequence[int]) -> None:
    """Until the router knows the three workers (a 2-token request is served)."""
    deadline_s = time.monotonic() + 120
    while True:
        try:
            timed_generate(stub, prompt, 2)
            return
        except grpc.RpcError as err:
            if time.monotonic() > deadline_s:
                raise RuntimeError(f"the router never served: {err}") from err
            time.sleep(1.0)


def abba(count: int) -> list[str]:
    """aware, blind, blind, aware, ... ``count`` of each."""
    order: list[str] = []
    for i in range(count):
        order += CONFIGS if i % 2 == 0 else CONFIGS[::-1]
    return order


def measured_link_rates(metrics_url: str) -> dict[str, float]:
    text = httpx.get(metrics_url, timeout=10).text
    return {
        sample.labels["decode"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "pdserve_router_link_bytes_per_second"
    }


def run_routing_bench(settings: RoutingSettings) -> RoutingRun:
    reason = skip_reason()
    if reason is not None:
        raise SystemExit(f"pdserve.bench.multi_host: {reason}")
    texts = PromptTexts(load_tokenize(default_model_file()))
    served: list[Served] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-linkbench-") as tmp, lan(HOSTS) as net:
        routers = routing_cluster(net, Path(tmp), settings.num_blocks)
        channels = {c: grpc.insecure_channel(routers[c]) for c in CONFIGS}
        try:
            stubs = {c: inference_pb2_grpc.InferenceStub(ch) for c, ch in channels.items()}
            for config in CONFIGS:
                _wait_serving(stubs[config], texts.take(64, "Ping"))
            for config in CONFIGS * settings.warmup:
                timed_generate(stubs[config], texts.take(settings.prompt_tokens), 2)
            for config in abba(settings.requests):
                prompt = texts.take(settings.prompt_tokens)
                decode, ttft_s, second_s = timed_generate(
                    stubs[config], prompt, settings.max_tokens
                )
                served.append(Served(config, decode, ttft_s, second_s))
            rates = measured_link_rates(routers["metrics"])
        finally:
            for channel in channels.values():
                channel.close()
    return RoutingRun(settings, tuple(served), rates)


# -- the report --------------------------------------------------------------------------


def p90(values: Sequence[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def format_routing_report(run: RoutingRun) -> str:
    s = run.settings
    lines = [
        f"{s.prompt_tokens}-token prompts, {s.max_tokens} tokens out, {s.requests} requests "
        f"per router (after {s.warmup} warm-up), one at a time",
        "router      | 1st->2nd token p50 / p90 ms | TTFT p50 / p90 ms | decode workers",
    ]
    figures: dict[str, tuple[float, float]] = {}
    for config in CONFIGS:
        rows = [r for r in run.served if r.config == config]
        second = [r.second_s * 1e3 for r in rows]
        ttft = [r.ttft_s * 1e3 for r in rows]
        split = ", ".join(f"{w} {n}" for w, n in sorted(Counter(r.decode_worker for r in rows)
                                                         .items()))  # fmt: skip
        figures[config] = (p90(second), p90(ttft))
        lines.append(f"{config:<11} | {statistics.median(second):8.0f} / {p90(second):6.0f}"
                     f"           | {statistics.median(ttft):6.0f} / {p90(ttft):6.0f}"
                     f"   | {split}")  # fmt: skip
    (aware_2nd, aware_ttft), (blind_2nd, blind_ttft) = figures["link-aware"], figures["link-blind"]
    lines.append(f"blind / aware: p90 1st->2nd token {blind_2nd / aware_2nd:.2f}x, "
                 f"p90 TTFT {blind_ttft / aware_ttft:.2f}x")  # fmt: skip
    rates = ", ".join(f"{w} {r * 8 / 1e9:.2f} Gbit/s" for w, r in sorted(run.link_rates.items()))
    lines.append(f"the link-aware router's measured KV rates from pf: {rates}")
    return "\n".join(lines)
