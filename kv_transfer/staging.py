"""Staging a pool's blocks through host memory, for a transport that reads and writes host
bytes only (the TCP backend's sockets) while the pool lives on a GPU.

Sending: ``gather`` copies the chosen blocks device -> host buffer; the socket sends from
there. Receiving: the socket fills a host buffer; ``scatter`` copies it host -> the chosen
device blocks. The buffer is pinned (page-locked) where a CUDA runtime is present, so the
copies run at the link's DMA rate instead of through a pageable bounce buffer. A CPU pool
can be staged too (a plain host buffer): that is how the path runs in tests on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def stages_through_host(pool: torch.Tensor, asked: bool | None) -> bool:
    """Whether transfers of ``pool`` go through a host buffer: as ``asked``, and by default
    when the pool is not in host memory (a socket cannot read device memory)."""
    in_host_memory = pool.device.type == "cpu"
    if asked is False and not in_host_memory:
        raise ValueError(
            f"a KV pool on {pool.device} must be staged through host memory for the TCP "
            "backend; leave stage_through_host unset"
        )
    return not in_host_memory if asked is None else asked


class HostStaging:
    """Host buffers shaped like ``pool``'s blocks, moving up to ``chunk_blocks`` at a time."""

    def __init__(self, pool: torch.Tensor, chunk_blocks: int) -> None:
        self._pool = pool
        pin = torch.cuda.is_available()  # pinning needs the CUDA runtime; else plain memory
        # [chunk_blocks, *pool block]: one pool block per row, in the pool's dtype
        self._buffer = torch.empty(
            (chunk_blocks, *pool.shape[1:]), dtype=pool.dtype, pin_memory=pin
        )

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """``pool[block_ids]`` copied into the host buffer; returns its filled rows (valid
        until the next call)."""
        rows = self.buffer(len(block_ids))
        index = torch.tensor(block_ids, dtype=torch.int64, device=self._pool.device)
        rows.copy_(self._pool.index_select(0, index))  # waits for the copy: rows are ready
        return rows

    def buffer(self, num_blocks: int) -> torch.Tensor:
        """The first ``num_blocks`` rows of the host buffer, to receive into."""
        assert num_blocks <= self._buffer.shape[0], (
            f"{num_blocks} blocks staged at once; the buffer holds {self._buffer.shape[0]}"
        )
        return self._buffer[:num_blocks]

    def scatter(self, rows: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Copy host ``rows`` ``[n, *pool block]`` into ``pool[block_ids]``."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self._pool.device)
        self._pool.index_copy_(0, index, rows.to(self._pool.device))
