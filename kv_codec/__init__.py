"""KV block codecs shared by the engine's cache tiers and KV transfer (tensors only)."""

from pdserve.kv_codec.int8 import SCALE_DTYPE, Int8Blocks, dequantize_blocks, quantize_blocks
from pdserve.kv_codec.int8_rows import ROW_SCALE_BYTES, dequantize_rows, quantize_rows

__all__ = [
    "ROW_SCALE_BYTES",
    "SCALE_DTYPE",
    "Int8Blocks",
    "dequantize_blocks",
    "dequantize_rows",
    "quantize_blocks",
    "quantize_rows",
]
