"""What every attempt shares: stubs by worker id, the load tracker, the measured link rates,
background Cancel calls."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import grpc

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import common_pb2, worker_pb2, worker_pb2_grpc
from pdserve.proto.params import params_message
from pdserve.proto.workers import WorkerInfo
from pdserve.router.config import RouterConfig
from pdserve.router.state.admission import LocalLoadTracker
from pdserve.router.state.directory import ChannelPool
from pdserve.router.state.link_rates import LinkRates

log = logging.getLogger(__name__)


class WorkerCalls:
    """Reaches the workers of one routing snapshot (``workers`` by id)."""

    def __init__(
        self,
        config: RouterConfig,
        channels: ChannelPool,
        tracker: LocalLoadTracker,
        workers: Mapping[str, WorkerInfo],
        background: set[asyncio.Task[None]],
        link_rates: LinkRates,
    ) -> None:
        self.config = config
        self.tracker = tracker
        self.link_rates = link_rates
        self._channels = channels
        self._workers = workers
        self._background = background

    def stub(self, worker_id: str) -> worker_pb2_grpc.WorkerStub:
        return self._channels.stub(self.address(worker_id))

    def address(self, worker_id: str) -> str:
        return self._workers[worker_id].address

    def params_message(self, params: SamplingParams) -> common_pb2.SamplingParams:
        """The protobuf form of ``params`` (shared: copy it into a request, never mutate)."""
        return params_message(params)

    def cancel_in_background(self, worker_id: str, request_id: str) -> None:
        """Send Cancel without waiting: it must also run when the caller is being cancelled."""
        task = asyncio.get_running_loop().create_task(self._cancel(worker_id, request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cancel(self, worker_id: str, request_id: str) -> None:
        request = worker_pb2.CancelRequest(request_id=request_id)
        try:
            await self.stub(worker_id).Cancel(request, timeout=self.config.worker_rpc_timeout_s)
        except grpc.aio.AioRpcError as err:
            # The worker also frees the request when our stream to it goes away.
            log.info("Cancel(%s) on worker %s failed: %s", request_id, worker_id, err.code())
