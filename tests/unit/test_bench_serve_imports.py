"""The benchmark is a client: it imports no torch and no engine/, cluster/ or router/ code."""

from __future__ import annotations

from tests.import_probe import run_probe


def test_bench_serve_imports_no_server_code_and_no_torch() -> None:
    run_probe(
        """
import pdserve.bench.serve
import pdserve.bench.serve.grpc_client, pdserve.bench.serve.plots, pdserve.bench.cli
from pdserve.bench.serve import RandomSpec, build_dataset
from pdserve.bench.serve.text import TextSource
assert len(build_dataset(RandomSpec(8, 2), 3, seed=0, source=TextSource())) == 3
""",
        ("torch",),
        ("pdserve.engine", "pdserve.cluster", "pdserve.router", "transformers", "matplotlib"),
    )
