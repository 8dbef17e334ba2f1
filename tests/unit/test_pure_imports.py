"""The policy packages import without torch or numpy (they must stay CPU-testable and pure)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
sys.modules["numpy"] = None
import pdserve.engine.kv_cache
import pdserve.engine.scheduler
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, Sequence

kv = KVCacheManager(4, 2)
sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2), kv)
sched.add(Sequence("a", [1, 2, 3]))
assert sched.schedule().num_batched_tokens == 3
heavy = sorted(m for m in ("torch", "numpy") if sys.modules.get(m) is not None)
assert not heavy, heavy
print("ok")
"""


def test_kv_cache_and_scheduler_import_with_torch_and_numpy_blocked() -> None:
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
