"""The committed stubs in pdserve_proto/ must match what proto/*.proto generates."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_are_current(tmp_path: Path) -> None:
    # protoc runs in its own process: grpc_tools' extension crashes when loaded into an
    # interpreter that already holds the grpc/torch/nixl extensions of other tests.
    run = subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    fresh = sorted(tmp_path.glob("*_pb2*.py*"))
    assert fresh, "protoc produced no files"
    for path in fresh:
        committed = ROOT / "pdserve_proto" / path.name
        assert committed.exists(), f"{committed} missing: run proto/generate.py"
        assert committed.read_text() == path.read_text(), (
            f"{committed.name} is stale: run proto/generate.py"
        )
