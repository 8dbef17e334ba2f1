"""The cluster under test: `pdserve up` as a child process, and the processes a fault hits.

Workers are found by id through `pdserve status --json` (which names each worker's pid),
router processes through the cluster's state file (the first is `pdserve up` itself, which
a fault must not kill: the cluster would go), redis-server among `pdserve up`'s descendants.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.bench.up_process import UpProcess, descendants

START_TIMEOUT_S = 900.0
ENV = {"PDSERVE_TORCH_THREADS": "1"}


@dataclass
class ChaosCluster:
    up: UpProcess

    @property
    def grpc_address(self) -> str:
        return self.up.grpc_address

    def worker_pids(self) -> dict[str, int]:
        """Registered workers: worker id -> pid."""
        return {w["worker_id"]: int(w["pid"]) for w in self.up.status()["workers"]}

    def spare_router_pids(self) -> list[int]:
        """The router processes other than `pdserve up` itself."""
        return [p for p in self.up.state["router_pids"] if p != self.up.process.pid]

    def redis_pid(self) -> int:
        (pid,) = [p for p, cmd in descendants(self.up.process.pid).items() if "redis-server" in cmd]
        return pid


def up_args(prefill: int, decode: int, routers: int, num_blocks: int) -> tuple[str, ...]:
    return (
        "--prefill", str(prefill), "--decode", str(decode),
        "--router-processes", str(routers), "--num-blocks", str(num_blocks),
    )  # fmt: skip
