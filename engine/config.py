"""Engine configuration: one frozen dataclass per component, composed by the caller."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pdserve.engine.scheduler import SchedulerConfig

DEFAULT_MODEL = "smollm2-135m-instruct"
DTYPES = ("float32", "bfloat16")


@dataclass(slots=True, frozen=True)
class CacheConfig:
    """The paged KV pool. Its size is fixed at start: ``num_blocks`` if given, else the budget."""

    block_size: int = 16
    num_blocks: int | None = None
    memory_budget_bytes: int = 2 * 1024**3
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")


@dataclass(slots=True, frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    attention_backend: str = "auto"
    max_model_len: int | None = None  # None: the model's own context length
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """Build from flat keyword arguments, routing each to the component that owns it.

        ``LLM(model=..., block_size=4, num_blocks=64, max_num_batched_tokens=16)`` is the
        offline API's way to reach the cache and scheduler settings.
        """
        own = {f.name for f in dataclasses.fields(cls)} - {"cache", "scheduler"}
        parts: dict[str, dict[str, object]] = {"own": {}, "cache": {}, "scheduler": {}}
        owners = {
            "cache": {f.name for f in dataclasses.fields(CacheConfig)},
            "scheduler": {f.name for f in dataclasses.fields(SchedulerConfig)},
        }
        for key, value in kwargs.items():
            if key in own:
                parts["own"][key] = value
            elif key in owners["cache"]:
                parts["cache"][key] = value
            elif key in owners["scheduler"]:
                parts["scheduler"][key] = value
            else:
                known = sorted(own | owners["cache"] | owners["scheduler"])
                raise ValueError(f"unknown engine option {key!r}; known options: {known}")
        return cls(
            cache=CacheConfig(**parts["cache"]),  # type: ignore[arg-type]
            scheduler=SchedulerConfig(**parts["scheduler"]),  # type: ignore[arg-type]
            **parts["own"],  # type: ignore[arg-type]
        )
