"""Walking one routing snapshot's ranking until an attempt completes.

Decisions are tried best first: a refused ``ReserveKV`` (back-pressure) moves to the next
decision with another decode worker; a worker failing before the first token moves to the
next decision without that worker, at most ``max_attempts`` times. Each try gets a fresh
request id (``<id>#k``) so a late Cancel of a failed one cannot hit it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from pdserve.router.edge.errors import NoWorkersError, OverloadedError, WorkerFailedError
from pdserve.router.policies import RouteDecision, RouteRequest
from pdserve.router.request.dispatch import Attempt, RetryableWorkerError
from pdserve.router.request.types import ChunkEvent, GenerateInput
from pdserve.router.request.worker_calls import WorkerCalls


@dataclass(slots=True)
class Route:
    """One request's routing snapshot and, once served, the attempt that served it."""

    inp: GenerateInput
    request: RouteRequest
    ranked: list[RouteDecision]
    calls: WorkerCalls
    deadline_at: float | None
    served_by: Attempt | None = None
    dispatched_s: float | None = None


async def walk(
    route: Route, failed: set[str], max_attempts: int
) -> AsyncGenerator[ChunkEvent, None]:
    """Chunks of the first attempt that completes; raises the router error when none does.

    ``failed`` holds workers not to try (shared by every walk of one request) and grows by
    the ones that fail here. ``route.served_by`` follows the attempt sending tokens.
    """
    refused: set[str] = set()
    failures: list[str] = []
    for decision in route.ranked:
        if len(failures) >= max_attempts:
            break
        if _skip(decision, failed, refused):
            continue
        attempt = Attempt(
            route.calls,
            route.inp,
            decision,
            _attempt_id(route.inp, failures, refused),
            route.deadline_at,
        )
        try:
            async with aclosing(attempt.run()) as chunks:
                async for chunk in chunks:
                    route.served_by = attempt  # the attempt that sent the latest tokens
                    yield chunk
        except RetryableWorkerError as err:
            attempt.abort()
            failures.append(str(err))
            failed.add(err.worker_id)
            continue
        except BaseException:
            attempt.abort()
            raise
        finally:
            if route.dispatched_s is None:
                route.dispatched_s = attempt.dispatched_s
        if attempt.refused:
            refused.add(decision.decode_worker_id or "")
            continue
        route.served_by = attempt
        return
    raise _exhausted(route, failures, refused)


def _skip(decision: RouteDecision, failed: set[str], refused: set[str]) -> bool:
    if decision.prefill_worker_id in failed or decision.decode_worker_id in failed:
        return True
    return decision.decode_worker_id is not None and decision.decode_worker_id in refused


def _attempt_id(inp: GenerateInput, failures: Sequence[str], refused: set[str]) -> str:
    # A retry uses a fresh id: a late Cancel for the failed attempt must not hit this one.
    tries = len(failures) + len(refused)
    return inp.request_id if tries == 0 else f"{inp.request_id}#{tries}"


def _exhausted(route: Route, failures: list[str], refused: set[str]) -> Exception:
    rid = route.inp.request_id
    if failures:
        return WorkerFailedError(
            f"request {rid} failed on {len(failures)} worker(s): {'; '.join(failures)}"
        )
    if refused:
        return OverloadedError(
            f"request {rid}: no decode worker has room for {route.request.blocks_needed} KV "
            f"blocks (refused by {sorted(refused)})",
            route.calls.config.retry_after_s,
        )
    return NoWorkersError(f"request {rid}: no worker available to route to")
