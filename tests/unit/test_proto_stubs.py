"""The committed stubs in proto/python/ must match what proto/pdserve/v1/*.proto generates."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_are_current(tmp_path: Path) -> None:
    # protoc runs in its own process: grpc_tools' extension crashes when loaded into an
    # interpreter that already holds the grpc/torch/nixl extensions of other tests.
    run = subprocess.run(
        [sys.executable, "-m", "pdserve.proto.generate", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    fresh = sorted(tmp_path.glob("*_pb2*.py*"))
    assert fresh, "protoc produced no files"
    for path in fresh:
        committed = ROOT / "proto" / "python" / path.name
        assert committed.exists(), f"{committed} missing: run python -m pdserve.proto.generate"
        assert committed.read_text() == path.read_text(), (
            f"{committed.name} is stale: run python -m pdserve.proto.generate"
        )
