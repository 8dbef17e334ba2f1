"""The autoscaling policy imports with torch, numpy, grpc, ray and redis all unavailable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import sys
for name in ("torch", "numpy", "grpc", "ray", "redis"):
    sys.modules[name] = None  # any import of them now raises ImportError
import pdserve.cluster.autoscale as autoscale
from pdserve.cluster.autoscale import (
    CapacityProfile, ClusterObservation, DecodePoint, LoadSample, Planner, PlannerConfig,
)
profile = CapacityProfile(1000.0, (DecodePoint(1, 50.0, 0.02),), 1, 10.0)
decision = Planner(PlannerConfig(), profile).decide(0.0, ClusterObservation(LoadSample(1, 1, 1)))
assert decision.prefill.replicas == 1, decision
heavy = sorted(
    m for m in ("torch", "numpy", "grpc", "ray", "redis") if sys.modules.get(m) is not None
)
assert not heavy, heavy
print("ok")
"""


def test_autoscale_imports_without_heavy_packages() -> None:
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
