"""`pdserve generate` with speculative decoding: the same greedy text as without it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.cluster.cli import main
from pdserve.engine import llm as llm_module

pytestmark = pytest.mark.slow

# Repeats itself, so prompt lookup finds candidates that greedy decoding accepts.
PROMPT = "red green blue, red green blue, red green blue, red green"


def _generate(capsys: pytest.CaptureFixture[str], *flags: str) -> dict[str, object]:
    argv = ["generate", "--prompt", PROMPT, "--max-tokens", "16", "--json", *flags]
    assert main(argv) == 0
    (line,) = capsys.readouterr().out.splitlines()
    record: dict[str, object] = json.loads(line)
    return record


def test_generate_with_ngram_speculation_gives_the_plain_greedy_text(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[llm_module.LLM] = []

    class RecordedLLM(llm_module.LLM):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(llm_module, "LLM", RecordedLLM)
    plain = _generate(capsys)
    speculated = _generate(capsys, "--speculative", "ngram", "--num-speculative-tokens", "4")
    assert speculated["token_ids"] == plain["token_ids"] and speculated["text"] == plain["text"]
    assert built[0].engine.speculator is None
    speculator = built[1].engine.speculator
    assert speculator is not None and speculator.config.num_speculative_tokens == 4
    assert speculator.stats.accepted_tokens > 0, speculator.stats
