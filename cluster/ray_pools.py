"""Ray side of the pools: one actor per worker, scaling, replacing lost workers.

Each worker is a Ray actor (``WorkerActor``) whose process hosts one worker server
(worker/host.py); the actor starts it in ``__init__``, so when Ray restarts a dead
actor (``max_restarts``) the new incarnation loads, warms up and registers by itself, with
a new epoch: the locality index then drops the old incarnation's entries. The pool only
steps in when Ray gives up (restarts exhausted): it starts a replacement in the same slot.

A pool bound to a host (``host=NAME``) places its actors only on the Ray node labelled
``pdserve.host=NAME`` (``HOST_LABEL``): `pdserve up --head` labels its own node, `pdserve join`
the node it adds, and each places its workers on its own host.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray.exceptions import (
    ActorUnavailableError,
    GetTimeoutError,
    RayActorError,
    RayTaskError,
)

from pdserve.cluster.cpu_affinity import core_for_worker, pin_process
from pdserve.cluster.pool_manager import MemberState, PoolMember, ScaleDecision, plan_scale
from pdserve.cluster.worker_launch import WorkerLaunch
from pdserve.worker.host import HostedWorker, WorkerHost

log = logging.getLogger("pdserve.pools")

WATCH_FOREVER_S = 10**9
HOST_LABEL = "pdserve.host"  # the Ray node label naming a pdserve host


class WorkerActor:
    """One worker per actor process. Methods run on Ray's threads (max_concurrency > 1)."""

    def __init__(self, launch: WorkerLaunch) -> None:
        logging.basicConfig(level=launch.log_level, format="%(levelname)s %(name)s: %(message)s")
        spec = launch.worker
        if spec.host == "auto":
            spec = replace(spec, host=ray.util.get_node_ip_address())
        core = core_for_worker(launch.cpu_affinity, spec.role, spec.worker_id)
        if core is not None:  # before the server thread starts: it inherits the pinning
            pin_process(core)
        self._host = WorkerHost(spec, launch.register()).start()

    def wait_ready(self, timeout_s: float) -> HostedWorker:
        return self._host.wait_ready(timeout_s)

    def watch(self) -> bool:
        """Returns when the hosted server has stopped; fails when this actor dies."""
        return self._host.wait_stopped(WATCH_FOREVER_S)

    def drain(self, timeout_s: float) -> int:
        return self._host.drain(timeout_s)

    def stop(self) -> None:
        self._host.stop()

    def pid(self) -> int:
        return os.getpid()


@dataclass(slots=True, frozen=True)
class ActorResources:
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_restarts: int = 3


@dataclass
class _Member:
    slot: int
    launch: WorkerLaunch
    actor: Any
    state: MemberState = MemberState.STARTING
    ready_ref: Any = None
    watch_ref: Any = None
    deaths: int = 0
    hosted: HostedWorker | None = None
    last_error: str = ""
    since_s: float = 0.0  # when it entered its state (monotonic)


class RayWorkerPool:
    """The workers of one role. Not thread-safe: drive it from one thread."""

    def __init__(
        self,
        role: str,
        template: WorkerLaunch,
        resources: ActorResources,
        host: str | None = None,
        id_prefix: str | None = None,
    ) -> None:
        """``host``: the pool's workers run only on that host's Ray node (None: anywhere).
        ``id_prefix``: worker ids are ``<id_prefix>-<slot>`` (default: the role)."""
        self.role = role
        self.template = template
        self.resources = resources
        self.host = host
        self.id_prefix = id_prefix or role
        self._members: dict[str, _Member] = {}

    def members(
        self, running: Mapping[str, int] | None = None, unique: Mapping[str, int] | None = None
    ) -> list[PoolMember]:
        """Members with their running requests (from the registry) and unique cached blocks
        (from the locality index); unknown = 0."""
        running, unique = running or {}, unique or {}
        return [
            PoolMember(wid, m.slot, m.state, running.get(wid, 0), m.since_s, unique.get(wid, 0))
            for wid, m in sorted(self._members.items())
        ]

    def hosted(self) -> list[HostedWorker]:
        """Serving workers (address, epoch, pid of their current incarnation)."""
        return [m.hosted for _, m in sorted(self._members.items()) if m.hosted is not None]

    def scale_to(
        self,
        target: int,
        drain_timeout_s: float = 30.0,
        running: Mapping[str, int] | None = None,
        unique: Mapping[str, int] | None = None,
    ) -> ScaleDecision:
        """Start or drain workers to reach ``target`` (draining first the one whose cache is
        least held elsewhere, by ``unique``, then the least busy, by ``running``); returns
        what it did. New workers are not waited for (see
        :meth:`wait_ready`); drained ones are stopped before this returns."""
        decision = plan_scale(self.id_prefix, self.members(running, unique), target)
        for worker_id in decision.start:
            self._start(worker_id)
        for worker_id in decision.drain:
            self._drain(worker_id, drain_timeout_s)
        return decision

    def wait_ready(self, timeout_s: float) -> list[HostedWorker]:
        """Block until every starting member serves; raises with the worker's error."""
        deadline_s = time.monotonic() + timeout_s
        while any(m.state is MemberState.STARTING for m in self._members.values()):
            if time.monotonic() > deadline_s:
                starting = [w for w, m in self._members.items() if m.state is MemberState.STARTING]
                raise TimeoutError(f"{self.role} workers {starting} not ready in {timeout_s} s")
            self.poll(timeout_s=0.5)
        failed = {
            w: m.last_error for w, m in self._members.items() if m.state is MemberState.FAILED
        }
        if failed:
            raise RuntimeError(f"{self.role} workers failed to start: {failed}")
        return self.hosted()

    def poll(self, timeout_s: float = 0.0) -> None:
        """Collect readiness and deaths (Ray restarts actors; a member whose restarts are
        exhausted becomes FAILED and the next :meth:`scale_to` replaces it)."""
        refs = {}
        for m in self._members.values():
            if m.ready_ref is not None:
                refs[m.ready_ref] = (m, "ready")
            if m.watch_ref is not None:
                refs[m.watch_ref] = (m, "watch")
        if not refs:
            return
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        for ref in done:
            member, kind = refs[ref]
            self._collect(member, kind, ref)

    def kill(self, worker_id: str) -> int:
        """SIGKILL a worker's process, as a crash would (Ray restarts it). Returns the pid."""
        hosted = self._members[worker_id].hosted
        assert hosted is not None, f"worker {worker_id} is not serving; cannot kill it"
        os.kill(hosted.pid, signal.SIGKILL)
        return hosted.pid

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop every worker (graceful, bounded by ``grace_s``), then kill the actors."""
        refs = [m.actor.stop.remote() for m in self._members.values()]
        try:
            ray.get(refs, timeout=grace_s)
        except (RayActorError, GetTimeoutError) as err:
            log.warning("%s pool: not every worker stopped gracefully: %r", self.role, err)
        for m in self._members.values():
            ray.kill(m.actor, no_restart=True)
        self._members.clear()

    # -- internals ---------------------------------------------------------------------
    def _start(self, worker_id: str) -> None:
        slot = int(worker_id.rsplit("-", 1)[1])
        launch = self.template.for_worker(self.role, worker_id)
        r = self.resources
        placement = {} if self.host is None else {"label_selector": {HOST_LABEL: self.host}}
        actor = (
            _actor_class()
            .options(
                **placement,
                num_cpus=r.num_cpus,
                num_gpus=r.num_gpus,
                max_restarts=r.max_restarts,
                max_concurrency=4,
                # set before the process imports anything: no model-load progress bars
                runtime_env={"env_vars": {"TQDM_DISABLE": "1"}},
            )
            .remote(launch)
        )
        member = _Member(slot, launch, actor)
        self._arm(member)
        self._members[worker_id] = member
        log.info("starting %s worker %s", self.role, worker_id)

    def _arm(self, member: _Member) -> None:
        member.state, member.since_s = MemberState.STARTING, time.monotonic()
        member.hosted = None
        member.ready_ref = member.actor.wait_ready.remote(WATCH_FOREVER_S)
        member.watch_ref = None

    def _collect(self, member: _Member, kind: str, ref: Any) -> None:
        try:
            value = ray.get(ref)
        except RayActorError as err:
            self._died(member, err)
            return
        except RayTaskError as err:  # the hosted server failed; its actor lives on
            self._server_failed(member, str(err))
            return
        if kind == "ready":
            member.hosted, member.state, member.ready_ref = value, MemberState.READY, None
            member.since_s = time.monotonic()
            member.watch_ref = member.actor.watch.remote()
            log.info("%s worker %s ready at %s (epoch %d)", self.role, value.worker_id,
                     value.address, value.epoch)  # fmt: skip
        elif member.state is MemberState.READY:
            self._server_failed(member, "its server stopped on its own")

    def _server_failed(self, member: _Member, error: str) -> None:
        """Restart the actor through Ray (it counts as one of its restarts)."""
        member.last_error = error[-2000:]
        log.error("%s worker %s failed: %s", self.role, member.launch.worker.worker_id, error)
        if self._out_of_restarts(member):
            ray.kill(member.actor, no_restart=True)
            return
        ray.kill(member.actor, no_restart=False)
        self._arm(member)

    def _died(self, member: _Member, err: RayActorError) -> None:
        if member.state is MemberState.DRAINING:
            return
        if isinstance(err, ActorUnavailableError):
            # Restarting: ask again (the call waits for the new incarnation, or fails fast).
            time.sleep(0.2)
            self._arm(member)
            return
        member.last_error = str(err)[-2000:]
        if self._out_of_restarts(member):
            return
        log.warning(
            "%s worker %s died (%s); Ray restarts it",
            self.role,
            member.launch.worker.worker_id,
            type(err).__name__,
        )
        self._arm(member)  # queued until the restarted incarnation is up

    def _out_of_restarts(self, member: _Member) -> bool:
        member.deaths += 1
        limit = self.resources.max_restarts
        if 0 <= limit < member.deaths:
            log.error("%s worker %s is lost for good after %d failures; last: %s", self.role,
                      member.launch.worker.worker_id, member.deaths, member.last_error)  # fmt: skip
            member.state, member.ready_ref, member.watch_ref = MemberState.FAILED, None, None
            return True
        return False

    def _drain(self, worker_id: str, timeout_s: float) -> None:
        member = self._members[worker_id]
        if member.state is MemberState.FAILED:
            del self._members[worker_id]
            return
        member.state = MemberState.DRAINING
        log.info("draining %s worker %s", self.role, worker_id)
        try:
            left = ray.get(member.actor.drain.remote(timeout_s), timeout=timeout_s + 10)
            if left:
                log.warning("%s still had %d requests after %.0f s", worker_id, left, timeout_s)
            ray.get(member.actor.stop.remote(), timeout=60)
        except (RayActorError, GetTimeoutError) as err:
            log.warning("draining %s failed: %r; killing it", worker_id, err)
        ray.kill(member.actor, no_restart=True)
        del self._members[worker_id]


@functools.cache
def _actor_class() -> Any:
    return ray.remote(WorkerActor)
