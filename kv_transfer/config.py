"""Configuration of a KV transfer endpoint (one frozen dataclass; cluster/ builds it)."""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_AUTH_KEY_BYTES = 16


@dataclass(slots=True, frozen=True)
class FaultInjection:
    """Test and benchmark hook: the sender pauses after ``pause_after_blocks`` blocks.

    Makes "mid-transfer" real in fault tests without multi-gigabyte transfers.
    """

    pause_after_blocks: int
    pause_s: float

    def __post_init__(self) -> None:
        if self.pause_after_blocks < 0 or self.pause_s < 0:
            raise ValueError(
                f"FaultInjection needs pause_after_blocks >= 0 and pause_s >= 0, got "
                f"{self.pause_after_blocks}, {self.pause_s}"
            )


@dataclass(slots=True, frozen=True)
class TransferConfig:
    """How an endpoint moves KV.

    ``timeout_s`` bounds a whole transfer from ``send``/``expect`` to DONE or FAILED.
    ``io_timeout_s`` bounds one stalled socket operation (TCP), so a silent peer fails the
    transfer long before the overall deadline. ``int8`` on a sender quantizes blocks for
    the wire; on a NIXL receiver it allocates the staging area int8 transfers land in.
    ``auth_key`` (derived from the cluster secret; hidden from ``repr``): TCP connections
    must pass the handshake of ``handshake.py`` before a byte of KV moves, NIXL notices
    must carry a MAC under it (``notice_mac.py``); None: no authentication (a single host,
    or tests). ``stage_through_host`` (TCP): copy blocks through a pinned host buffer
    (``staging.py``); None: when the pool is on a GPU.
    """

    timeout_s: float = 30.0
    io_timeout_s: float = 5.0
    int8: bool = False
    host: str = "127.0.0.1"  # TCP receiver: address to bind and advertise
    port: int = 0  # TCP receiver: 0 picks a free port
    # UCX transports for NIXL; on this machine shared-memory-only sets refuse to start, so
    # tcp must be present. Applied only when UCX_TLS is not already set in the environment.
    ucx_tls: str = "tcp,self,sm"
    # NIXL's progress thread busy-polls (~0.6 of a core per idle agent, measured here); our
    # sender and receiver poll NIXL themselves while transfers are open, which drives UCX.
    nixl_progress_thread: bool = False
    max_concurrent_sends: int = 4
    # TCP receiver: connections served at once (a thread each); more are refused at once,
    # so a flood of connections (or of silent ones) cannot pile up threads.
    max_receive_connections: int = 256
    fault: FaultInjection | None = None
    stage_through_host: bool | None = None
    auth_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.auth_key is not None and len(self.auth_key) < MIN_AUTH_KEY_BYTES:
            raise ValueError(
                f"auth_key must be at least {MIN_AUTH_KEY_BYTES} bytes, got {len(self.auth_key)}"
            )
        if self.timeout_s <= 0 or self.io_timeout_s <= 0:
            raise ValueError(
                f"timeout_s and io_timeout_s must be > 0, got {self.timeout_s}, {self.io_timeout_s}"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_concurrent_sends < 1 or self.max_receive_connections < 1:
            raise ValueError(
                f"max_concurrent_sends and max_receive_connections must be >= 1, got "
                f"{self.max_concurrent_sends}, {self.max_receive_connections}"
            )
        if "tcp" not in self.ucx_tls.split(",") and self.ucx_tls != "all":
            raise ValueError(
                f"ucx_tls={self.ucx_tls!r} lacks 'tcp'; UCX here refuses shared-memory-only "
                "transport sets (try 'tcp,self,sm')"
            )
