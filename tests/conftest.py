"""Session-wide fixtures shared by every test directory.

Loading the real model (ours or transformers') takes seconds, so each is loaded at most once
per session, and only by the tests that ask for it. Heavy imports stay inside the fixtures.
"""

from __future__ import annotations

import os

# gRPC's fork handlers can abort a child forked for exec (redis-server, workers) while other
# threads use gRPC; the children exec at once and need none of them. Set before grpc loads.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.model.registry import ModelSource, resolve_model


@pytest.fixture(scope="session")
def default_model_source() -> ModelSource:
    """The default model (SmolLM2-135M-Instruct GGUF from the installed package)."""
    return resolve_model(None)


@pytest.fixture(scope="session")
def default_model_path(default_model_source: ModelSource) -> Path:
    """Path of the default model's GGUF file."""
    return default_model_source.path


def _one_torch_thread() -> None:
    # The test machine is shared by parallel jobs: with 2 OpenMP threads spinning against
    # other processes a forward pass gets ~10x slower than with one thread.
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_model(default_model_source: ModelSource) -> Any:
    """Our fp32 ``LlamaModel`` of the default model."""
    from pdserve.engine.model.loader import load_model

    _one_torch_thread()
    return load_model(default_model_source, show_progress=False)


@pytest.fixture(scope="session")
def hf_smollm2(default_model_path: Path) -> Any:
    """transformers' ``LlamaForCausalLM`` loaded from the same GGUF file, fp32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    _one_torch_thread()
    model = AutoModelForCausalLM.from_pretrained(
        str(default_model_path.parent), gguf_file=default_model_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(default_model_source: ModelSource) -> Any:
    """Our :class:`pdserve.engine.tokenizer.Tokenizer` of the default model."""
    from pdserve.engine.tokenizer import load_tokenizer

    return load_tokenizer(default_model_source)


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(default_model_path: Path) -> Any:
    """transformers' tokenizer loaded independently from the same GGUF file."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(default_model_path.parent), gguf_file=default_model_path.name
    )
