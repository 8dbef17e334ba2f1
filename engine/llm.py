"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from tqdm import tqdm

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import CompletionOutput, RequestOutput, StepOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.worker_state import LoadedModel

Prompt = str | Sequence[int]


class LLM:
    """Runs the engine in this process over a list of prompts (text or token ids)."""

    def __init__(
        self, model: str | None = None, *, loaded: LoadedModel | None = None, **config: object
    ) -> None:
        if model is not None:
            config["model"] = model
        self.engine = LLMEngine(EngineConfig.from_kwargs(**config), loaded)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        on_step: Callable[[StepOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in prompt order.

        ``on_step`` sees every streamed delta (the CLI prints tokens as they come).
        """
        prompt_list = _as_prompt_list(prompts)
        param_list = _as_param_list(params, len(prompt_list))
        results: dict[str, RequestOutput] = {}
        for prompt, p in zip(prompt_list, param_list, strict=True):
            request_id = str(next(self._ids))
            token_ids = self._encode(prompt)
            self.engine.add_request(request_id, token_ids, p)
            outputs = [CompletionOutput(index=i) for i in range(p.n)]
            results[request_id] = RequestOutput(request_id, token_ids, outputs)
        bar = tqdm(total=len(results), desc="generate", unit="req", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for step in self.engine.step():
                result = results[step.request_id]
                result.outputs[step.index].add(step)
                if on_step is not None:
                    on_step(step)
                if step.finished and result.finished:
                    bar.update(1)
        bar.close()
        return list(results.values())

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.engine.tokenizer.encode(prompt))
        return [int(t) for t in prompt]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [[int(t) for t in items]]  # type: ignore[arg-type]  # one prompt of token ids
    return [p for p in items if not isinstance(p, int)]


def _as_param_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(
            f"got {len(params)} SamplingParams for {count} prompts; pass one or one each"
        )
    return list(params)
