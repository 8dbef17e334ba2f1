"""Which torch device an engine runs on: the ``device`` option resolved once, at start.

``auto`` is CUDA when torch sees a GPU, else the CPU. Asking for CUDA where there is none
is the caller's mistake, so it raises ValueError with what was found, not a CUDA error
from deep inside the first allocation.
"""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """``"auto"`` | ``"cpu"`` | ``"cuda"`` | ``"cuda:N"`` -> a device this process can use."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {name!r} asked for, but torch sees no CUDA device (torch "
            f"{torch.__version__}, built for CUDA {torch.version.cuda}); use --device cpu"
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(
            f"device {name!r} asked for, but torch sees {torch.cuda.device_count()} CUDA device(s)"
        )
    return device
