"""The committed stubs in pdserve_proto/ must match what proto/*.proto generates."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load_generator():
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_are_current(tmp_path: Path) -> None:
    fresh = _load_generator().generate(tmp_path)
    assert fresh, "protoc produced no files"
    for path in fresh:
        committed = ROOT / "pdserve_proto" / path.name
        assert committed.exists(), f"{committed} missing: run proto/generate.py"
        assert committed.read_text() == path.read_text(), (
            f"{committed.name} is stale: run proto/generate.py"
        )
