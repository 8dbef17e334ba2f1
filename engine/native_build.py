"""Build the engine's C sources into shared libraries at first use, and load them (ctypes).

Every C source and header lives in ``engine/csrc/``; each kernel's Python wrapper, next to
the code that calls it, names its source there. The first process that wants a library
compiles it with the system C compiler (``cc``, about a second) into the pdserve cache
directory, keyed by the source (with the local headers it includes), the flags and this
CPU's feature flags (``-march=native``), and later processes load that file. The result is
written to a temporary name and renamed, so workers starting at once never load a
half-written library. Without a compiler, or on a failed build, the loader logs why and
callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from pdserve.engine.paths import cache_dir

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")  # every C source and header of the engine
BUILD_TIMEOUT_S = 120
# What every library is built with; a source adds its own floating-point flags.
BASE_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11")


def load_library(source: Path, cflags: tuple[str, ...], what: str) -> ctypes.CDLL | None:
    """``source`` built with ``cflags`` and loaded; None, with the reason logged as a warning
    naming ``what``, when it cannot be (the caller keeps its torch path)."""
    try:
        return ctypes.CDLL(str(built_library(source, cflags)))
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("%s unavailable, using the torch path: %s", what, err)
        return None


def built_library(source: Path, cflags: tuple[str, ...]) -> Path:
    """The library of ``source``, compiling it unless this machine has it already."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    text = source.read_bytes() + _local_headers(source)
    key = hashlib.sha256(text + " ".join(cflags).encode() + _cpu_identity()).hexdigest()
    target = cache_dir() / "native" / f"{source.stem}-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        _compile(compiler, source, cflags, temp_name)
        os.replace(temp_name, target)  # atomic: a concurrent loader sees all or nothing
    finally:
        if os.path.exists(temp_name):
            os.unlink(temp_name)
    for stale in target.parent.glob(f"{source.stem}-*.so"):
        if stale != target:  # older sources or flags; a process using one keeps its mapping
            stale.unlink(missing_ok=True)
    log.info("built %s into %s", source.name, target)
    return target


def _local_headers(source: Path, seen: frozenset[Path] = frozenset()) -> bytes:
    """The text of the headers ``source`` includes with quotes (ours, found relative to the
    file that includes them), and of those they include, so that editing a shared header
    rebuilds every library that includes it, directly or not."""
    names = re.findall(rb'^#include "([^"]+)"', source.read_bytes(), flags=re.MULTILINE)
    text = b""
    for name in names:
        header = (source.parent / name.decode()).resolve()
        if header not in seen:  # include guards let headers include each other
            text += header.read_bytes() + _local_headers(header, seen | {header})
    return text


def _compile(compiler: str, source: Path, cflags: tuple[str, ...], output: str) -> None:
    command = [compiler, *cflags, str(source), "-o", output, "-lm"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0:
        raise OSError(f"`{' '.join(command)}` failed ({done.returncode}): {done.stderr[-2000:]}")


def _cpu_identity() -> bytes:
    """What ``-march=native`` depends on: the machine and its CPU feature flags."""
    flags = " ".join(sorted(cpu_flags())) or platform.processor()
    return f"{platform.machine()}|{flags}".encode()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux names them (``avx512_bf16``, ``amx_bf16``, ...);
    empty where /proc/cpuinfo cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())
