"""The tokenizer the router is given: the engine's own (``load_router_tokenizer``); tests may
pass a fake one."""

from __future__ import annotations

from typing import Any, Protocol


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


class RouterTokenizer:
    """The engine's tokenizer with what the router also needs: model id and context length."""

    def __init__(self, engine_tokenizer: Any, model_id: str, max_context_tokens: int) -> None:
        self._tok = engine_tokenizer
        self._model_id = model_id
        self._max_context_tokens = max_context_tokens

    @property
    def eos_token_id(self) -> int | None:
        eos: int | None = self._tok.eos_token_id
        return eos

    @property
    def max_context_tokens(self) -> int:
        return self._max_context_tokens

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def vocab_size(self) -> int:
        size: int = self._tok.vocab_size
        return size

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self._tok.apply_chat_template(messages))

    def decode(self, ids: list[int]) -> str:
        text: str = self._tok.decode(ids)
        return text


def load_router_tokenizer(model: str) -> RouterTokenizer:
    """Tokenizer and context length of ``--model`` (reads the tokenizer and the model's
    metadata, not its weights)."""
    from pdserve.engine.model.loader import load_model_config
    from pdserve.engine.model.registry import resolve_model
    from pdserve.engine.tokenizer import load_tokenizer

    source = resolve_model(model)
    config = load_model_config(source)
    return RouterTokenizer(load_tokenizer(source), source.model_id, config.max_context_tokens)
