"""Running a snippet in a fresh interpreter where some packages cannot be imported, and
checking that neither they nor some other modules got loaded."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

_TEMPLATE = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None  # any import of it now raises ImportError
{code}
loaded = sorted(m for m in sys.modules if m.startswith({absent!r}) and sys.modules[m])
assert not loaded, loaded
print("ok")
"""


def run_probe(code: str, blocked: Sequence[str], absent: Sequence[str] = ()) -> None:
    """``code`` runs with ``blocked`` unimportable, and leaves none of ``blocked`` or
    ``absent`` (module name prefixes) loaded."""
    script = _TEMPLATE.format(
        blocked=tuple(blocked), code=code, absent=(*tuple(blocked), *tuple(absent))
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
