"""KV block codecs shared by the engine's cache tiers and KV transfer (tensors only)."""

from pdserve.kv_codec.int8 import SCALE_DTYPE, Int8Blocks, dequantize_blocks, quantize_blocks

__all__ = ["SCALE_DTYPE", "Int8Blocks", "dequantize_blocks", "quantize_blocks"]
