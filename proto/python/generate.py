"""Regenerate the protobuf/gRPC stubs in proto/python/ (the package ``pdserve.proto``) from
proto/pdserve/v1/*.proto.

Run `.venv/bin/python -m pdserve.proto.generate [OUT_DIR]`; a test checks the committed stubs
are current.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

HERE = Path(__file__).resolve().parent  # proto/python/
SRC = HERE.parent  # proto/: the .proto sources under pdserve/v1/
OUT = HERE


def generate(out_dir: Path = OUT) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = sorted(str(p.relative_to(SRC)) for p in (SRC / "pdserve" / "v1").glob("*.proto"))
    args = ["protoc", f"-I{SRC}", f"--python_out={out_dir}", f"--pyi_out={out_dir}"]
    args += [f"--grpc_python_out={out_dir}", *sources]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {sources}")
    return _flatten(out_dir)


def _flatten(out_dir: Path) -> list[Path]:
    """Move pdserve/v1/x_pb2.py to x_pb2.py and rewrite imports to the pdserve.proto package."""
    written = []
    for path in sorted((out_dir / "pdserve" / "v1").glob("*")):
        text = re.sub(
            r"from pdserve\.v1 import (\w+)", r"from pdserve.proto import \1", path.read_text()
        )
        target = out_dir / path.name
        target.write_text(text)
        path.unlink()
        written.append(target)
    for d in (out_dir / "pdserve" / "v1", out_dir / "pdserve"):
        d.rmdir()
    return written


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    for p in generate(out):
        print(p)
