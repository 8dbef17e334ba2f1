"""Run the project's Triton kernels under Triton's interpreter, on CPU tensors.

Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` function is DECORATED, that is when
its module is first imported, not when it launches; that holds for Triton's own library too
(``tl.zeros``, ``tl.max``, ``tl.sum`` are jit functions of ``triton.language.standard``), so
a kernel runs under the interpreter only if Triton itself was imported with the flag set.
:func:`interpreted_kernels` therefore sets the flag, imports Triton's Python modules (not its
compiled extension) and the kernel packages afresh, and on exit puts back the flag and every
module that was there before: nothing decorated for the interpreter outlives the tests that
asked for it (a later GPU test in the same process gets compiled kernels), and nothing
imported earlier without the flag reaches these tests. The interpreted modules retire under
private names in ``sys.modules`` rather than out of it: shutdown then tears them down with
the rest, where dropped ones would outlive Triton's extension (nanobind reports them as
leaks at exit).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import pytest
import torch

RETIRED_PREFIX = "_triton_interpreted_"
# How a test module runs its kernels: under the interpreter on CPU tensors (everywhere), and
# compiled on a GPU where there is one.
MODES = ("interpreter", "cuda") if torch.cuda.is_available() else ("interpreter",)
KERNEL_PACKAGES = ("pdserve.engine.attention.triton", "pdserve.engine.model.triton_ops")


def _decorated_at_import(name: str) -> bool:
    """Modules whose jit functions took the flag's value when imported: ours and Triton's
    Python modules (its compiled extension ``triton._C`` is loaded once and kept)."""
    if name == "triton._C" or name.startswith("triton._C."):
        return False
    return any(name == p or name.startswith(p + ".") for p in ("triton", *KERNEL_PACKAGES))


def require_triton() -> None:
    """Skip (with the reason) where Triton is not installed; CI installs it."""
    if importlib.util.find_spec("triton") is None:  # not imported: that would decorate it
        pytest.skip("triton is not installed here; CI installs it and runs these tests")


@contextmanager
def interpreted_kernels(*module_names: str) -> Iterator[list[ModuleType]]:
    """``module_names`` imported with ``TRITON_INTERPRET=1`` (see the module docstring)."""
    require_triton()
    saved_flag = os.environ.get("TRITON_INTERPRET")
    saved = {n: m for n, m in sys.modules.items() if _decorated_at_import(n)}
    for name in saved:
        del sys.modules[name]
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield [importlib.import_module(name) for name in module_names]
    finally:
        if saved_flag is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved_flag
        for name in [n for n in sys.modules if _decorated_at_import(n)]:
            sys.modules[f"{RETIRED_PREFIX}{id(saved)}.{name}"] = sys.modules.pop(name)
        sys.modules.update(saved)
        for package in KERNEL_PACKAGES:  # the parent package's attribute follows sys.modules
            parent_name, _, child = package.rpartition(".")
            parent = sys.modules.get(parent_name)
            if parent is None:
                continue
            if package in saved:
                setattr(parent, child, saved[package])
            elif hasattr(parent, child):
                delattr(parent, child)


@contextmanager
def kernels_for(mode: str, *module_names: str) -> Iterator[tuple[list[ModuleType], torch.device]]:
    """``module_names`` and the device their tensors live on, for one of :data:`MODES`."""
    if mode == "interpreter":
        with interpreted_kernels(*module_names) as modules:
            yield modules, torch.device("cpu")
        return
    require_triton()
    yield [importlib.import_module(name) for name in module_names], torch.device("cuda")
