"""The benchmark is a client: it imports no torch and no engine/, cluster/ or router/ code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import pdserve.bench.serve
import pdserve.bench.serve.grpc_client, pdserve.bench.serve.plots, pdserve.bench.cli
from pdserve.bench.serve import RandomSpec, build_dataset
from pdserve.bench.serve.text import TextSource
assert len(build_dataset(RandomSpec(8, 2), 3, seed=0, source=TextSource())) == 3
banned = ("torch", "pdserve.engine", "pdserve.cluster", "pdserve.router", "transformers",
          "matplotlib")
loaded = sorted(m for m in sys.modules if m.startswith(banned) and sys.modules[m])
assert not loaded, loaded
print("ok")
"""


def test_bench_serve_imports_no_server_code_and_no_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
