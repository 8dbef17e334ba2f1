"""CUDA graphs for decode steps: the bucket policy and padding (pure, ``buckets.py``) and the
capture/replay layer around it (``runner.py``)."""

from pdserve.engine.cuda_graphs.buckets import bucket_for, graph_capture_sizes, pad_decode_batch
from pdserve.engine.cuda_graphs.runner import (
    SCRATCH_BLOCKS,
    DecodeGraph,
    DecodeGraphs,
    cuda_graph_factory,
)

__all__ = [
    "SCRATCH_BLOCKS",
    "DecodeGraph",
    "DecodeGraphs",
    "bucket_for",
    "cuda_graph_factory",
    "graph_capture_sizes",
    "pad_decode_batch",
]
