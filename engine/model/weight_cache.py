"""A disk cache of GGUF models after parsing and dequantization.

Parsing GGUF metadata and dequantizing its tensors takes seconds, and every worker process
would pay it at start. The first load writes the config (JSON) and the dequantized weights
(safetensors) to the cache; later loads memory-map them. The key covers the file's path, size
and mtime and the dtype, so a changed file or another dtype gets a new entry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.model.config import ModelConfig, RopeScaling
from pdserve.engine.paths import cache_dir

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "weights.safetensors"


def entry_for(gguf_path: Path, dtype: torch.dtype) -> Path:
    stat = gguf_path.stat()
    ident = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}"
    return cache_dir() / "weights" / hashlib.sha256(ident.encode()).hexdigest()[:16]


def read(entry: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]] | None:
    """The cached config and weights, or None when the entry is absent."""
    if not (entry / WEIGHTS_FILE).exists():
        return None
    raw = json.loads((entry / CONFIG_FILE).read_text())
    scaling = raw.pop("rope_scaling")
    config = ModelConfig(
        **{**raw, "eos_token_ids": tuple(raw["eos_token_ids"])},
        rope_scaling=RopeScaling(**scaling) if scaling else None,
    )
    return config, load_file(str(entry / WEIGHTS_FILE))


def write(entry: Path, config: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    """Write into a fresh folder, then rename, so concurrent readers never see half an entry."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=entry.parent))
    (staging / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(config)))
    save_file(state, str(staging / WEIGHTS_FILE))
    try:
        staging.rename(entry)
    except OSError:  # another process won the race; its entry is as good as ours
        shutil.rmtree(staging, ignore_errors=True)
