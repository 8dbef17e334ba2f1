"""The tokenizer the router is given (the engine's own; tests may pass a fake one)."""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    """What the router needs from a tokenizer. Text <-> token ids of one model."""

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def max_context_tokens(self) -> int:
        """Prompt plus generated tokens may not exceed this."""
        ...

    @property
    def model_id(self) -> str: ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as a prompt (special tokens such as BOS included)."""
        ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat (``{"role", "content"}`` dicts) ending in the assistant turn."""
        ...

    def decode(self, ids: list[int]) -> str: ...
