"""The router's configuration: one frozen dataclass, built by cluster/ from the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.router.observe.goodput import SloConfig
from pdserve.router.policies import DEFAULT_POLICY, CostModel, normalize_policy_name


@dataclass(slots=True, frozen=True)
class RouterConfig:
    """Limits, timeouts, routing and security settings of one router process.

    ``api_keys`` empty = no authentication. Keys are excluded from ``repr`` so that logging
    a config never leaks them.
    """

    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    served_model_names: tuple[str, ...] = ()  # empty: the tokenizer's model id
    default_policy: str = DEFAULT_POLICY
    hot_spot_margin_requests: int = 4
    cost: CostModel = field(default_factory=CostModel)
    # joint_ttft may send a prefill worker to fetch a prompt prefix another prefill worker
    # holds (PrefillRequest.peer_prefix) when the cost model says moving beats computing.
    peer_fetch: bool = True
    # Price each (prefill, decode) link at its measured KV rate (router/state/link_rates.py);
    # off, routing is blind to links: every pair costs CostModel.link_bytes_per_s. The
    # rates are measured either way (/metrics shows them).
    link_aware: bool = True
    block_size: int = 16
    # Limits.
    max_concurrent_requests: int = 1024
    # The limit follows the SLO between these two (state/admission.py, ConcurrencyLimiter);
    # off: it stays at max_concurrent_requests.
    adaptive_concurrency: bool = False
    min_concurrent_requests: int = 4
    retry_after_s: int = 1
    # Refuse (429 / RESOURCE_EXHAUSTED) a request that would wait, behind work already
    # queued, more than this many times the TTFT objective (state/admission.py,
    # SloShedding); 0 = never.
    shed_ttft_factor: float = 0.0
    max_tokens_limit: int = 4096
    default_max_tokens: int = 16
    # Timeouts and retries.
    request_timeout_s: float = 600.0  # used when the client sets no deadline; 0 = none
    worker_rpc_timeout_s: float = 10.0  # ReserveKV, Cancel, GetStats
    transfer_timeout_s: float = 30.0
    max_attempts: int = 3  # workers tried before the first token
    # Security and transport.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    tls_cert_path: str | None = None
    tls_key_path: str | None = None
    max_message_bytes: int = 16 * 1024 * 1024
    # Bind both ports with SO_REUSEPORT, so that several router processes serve them
    # (router/processes.py); off, a second router on the same ports fails to bind.
    reuse_port: bool = False
    # SLO targets and goodput windows (/metrics, /dashboard, Redis when a URL is given).
    slo: SloConfig = field(default_factory=SloConfig)

    def __post_init__(self) -> None:
        normalize_policy_name(self.default_policy)
        _positive("max_concurrent_requests", self.max_concurrent_requests)
        _positive("min_concurrent_requests", self.min_concurrent_requests)
        _positive("max_tokens_limit", self.max_tokens_limit)
        _positive("default_max_tokens", self.default_max_tokens)
        _positive("max_attempts", self.max_attempts)
        _positive("block_size", self.block_size)
        _positive("max_message_bytes", self.max_message_bytes)
        if self.shed_ttft_factor < 0:
            raise ValueError(f"shed_ttft_factor must be >= 0, got {self.shed_ttft_factor}")
        if self.request_timeout_s < 0 or self.worker_rpc_timeout_s <= 0:
            raise ValueError(
                f"request_timeout_s must be >= 0 and worker_rpc_timeout_s > 0, got "
                f"{self.request_timeout_s} and {self.worker_rpc_timeout_s}"
            )
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            raise ValueError("TLS needs both tls_cert_path and tls_key_path, or neither")
        if any(not key for key in self.api_keys):
            raise ValueError("api_keys must not contain empty strings")


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
