"""Engine configuration: one frozen dataclass per component, composed by the caller."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pdserve.engine.scheduler import SchedulerConfig
from pdserve.engine.speculative.config import SpeculativeConfig

DEFAULT_MODEL = "smollm2-135m-instruct"
DTYPES = ("float32", "bfloat16")
TIER_CODECS = ("exact", "int8")
# What the KV pool holds: "auto" = the model's dtype, "int8" = int8 rows with a scale each
# (engine/attention/kv_format.py): about twice the tokens in the same memory as bf16.
KV_CACHE_DTYPES = ("auto", "int8")
# Where weights, the KV pool and sampling live: "auto" = CUDA when torch sees a GPU, else
# the CPU; "cuda" asks for the GPU and fails clearly without one ("cuda:N" picks one).
DEVICES = ("auto", "cpu", "cuda")


@dataclass(slots=True, frozen=True)
class CacheConfig:
    """The paged KV pool. Its size is fixed at start: ``num_blocks`` if given, else the budget.

    ``kv_cache_dtype``: what the pool holds, one of ``KV_CACHE_DTYPES``.

    Tiers under the pool (prefix caching on): cached blocks the pool evicts are kept in host
    memory (``host_tier_bytes``, 0 = off), and what that pushes out goes to files under
    ``disk_tier_path`` (None = off) within ``disk_tier_bytes``; ``tier_codec`` is how both
    keep a block: ``exact`` (its bytes) or ``int8`` (about half a bf16 block, not
    bit-exact; ``engine/tiers/codec.py``).
    """

    block_size: int = 16
    num_blocks: int | None = None
    memory_budget_bytes: int = 2 * 1024**3
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    host_tier_bytes: int = 0
    disk_tier_path: str | None = None
    disk_tier_bytes: int = 16 * 1024**3
    tier_codec: str = "exact"

    def __post_init__(self) -> None:
        if self.tier_codec not in TIER_CODECS:
            raise ValueError(f"tier_codec must be one of {TIER_CODECS}, got {self.tier_codec!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.host_tier_bytes < 0 or self.disk_tier_bytes < 0:
            raise ValueError(
                f"tier sizes must be >= 0, got host_tier_bytes={self.host_tier_bytes}, "
                f"disk_tier_bytes={self.disk_tier_bytes}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")


@dataclass(slots=True, frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    attention_backend: str = "auto"
    device: str = "auto"  # one of DEVICES, or "cuda:N"; resolved by engine/device.py
    # CUDA graphs for pure-decode steps (engine/cuda_graphs/); ignored off CUDA.
    cuda_graphs: bool = True
    max_model_len: int | None = None  # None: the model's own context length
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculation: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be one of {DEVICES} or cuda:N, got {self.device!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """Build from flat keyword arguments, routing each to the component that owns it.

        ``LLM(model=..., block_size=4, num_blocks=64, max_num_batched_tokens=16)`` is the
        offline API's way to reach the cache and scheduler settings;
        ``speculative="ngram"`` sets the speculative method (``SpeculativeConfig.method``).
        """
        components: dict[str, type] = {
            "cache": CacheConfig,
            "scheduler": SchedulerConfig,
            "speculation": SpeculativeConfig,
        }
        own = {f.name for f in dataclasses.fields(cls)} - set(components)
        owners = {
            name: {f.name for f in dataclasses.fields(part)} for name, part in components.items()
        }
        owners["speculation"] = (owners["speculation"] - {"method"}) | {"speculative"}
        parts: dict[str, dict[str, object]] = {name: {} for name in ("own", *components)}
        for key, value in kwargs.items():
            owner = next((name for name, keys in owners.items() if key in keys), None)
            if key in own:
                parts["own"][key] = value
            elif owner is not None:
                parts[owner]["method" if key == "speculative" else key] = value
            else:
                known = sorted(own.union(*owners.values()))
                raise ValueError(f"unknown engine option {key!r}; known options: {known}")
        built = {name: part(**parts[name]) for name, part in components.items()}
        return cls(**built, **parts["own"])  # type: ignore[arg-type]
