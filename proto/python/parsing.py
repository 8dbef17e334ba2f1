"""Reading a request message from the bytes gRPC received, with an error a caller can act on.

Servers that register their methods with raw bytes (the router's Inference service, the
worker's Worker service) parse here: bytes that are not the message are a ``ValueError``
naming the message type (INVALID_ARGUMENT at their edge), where gRPC's own deserializer
would answer with a bare "Exception deserializing request".
"""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import DecodeError, Message

M = TypeVar("M", bound=Message)


def parse_request(cls: type[M], raw: bytes) -> M:
    """``cls`` parsed from ``raw``; ValueError naming ``cls`` when the bytes are not one."""
    try:
        return cls.FromString(raw)
    except DecodeError as err:
        raise ValueError(
            f"request: not a valid {cls.DESCRIPTOR.full_name} protobuf ({len(raw)} bytes): {err}"
        ) from err
