"""``/metrics`` (Prometheus text), ``/dashboard`` (the ops page) and ``/dashboard/data``.

The page is static HTML + our own JS/CSS shipped in ``router/observe/static/`` as package
data; it polls ``/dashboard/data`` every second and keeps its history client-side, so the router
keeps no time series. None of these routes needs an API key (like ``/health``): they
expose load figures, never prompts or keys.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from pdserve.router.observe.dashboard_data import dashboard_data
from pdserve.router.observe.observability import RouterObservability

_STATIC_TYPES = {
    "charts.js": "text/javascript; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}


def static_file(name: str) -> bytes:
    """A file of ``router/observe/static/`` (package data)."""
    return resources.files("pdserve.router.observe").joinpath("static", name).read_bytes()


def mount_observability(app: FastAPI, obs: RouterObservability) -> None:
    """Add the metrics and dashboard routes to the router's HTTP app."""
    page = static_file("dashboard.html")
    assets = {name: static_file(name) for name in _STATIC_TYPES}

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(await obs.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/data", include_in_schema=False)
    async def data() -> Any:
        return JSONResponse(await dashboard_data(obs), headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in assets:  # a fixed list: no path from the URL reaches the filesystem
            raise HTTPException(404, f"no dashboard asset {name!r}; have {sorted(assets)}")
        return Response(assets[name], media_type=_STATIC_TYPES[name])
