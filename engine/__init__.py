"""The inference engine: model, paged KV cache, scheduler, sampler and the step loop.

Importing ``pdserve.engine`` is cheap; torch loads when ``LLM`` or ``LLMEngine`` is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.llm import LLM

__all__ = ["LLM", "LLMEngine", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pdserve.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pdserve.engine.engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'pdserve.engine' has no attribute {name!r}")
