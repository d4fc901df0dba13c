"""Running an engine over many prompts: chunks, compilation first (untimed), progress, merged statistics."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import specjax
from specjax import metrics

from experiments import _cli


def chunks(items: Sequence, size: int) -> list:
    return [items[i: i + size] for i in range(0, len(items), size)]


def compile_for(engine: specjax.Engine, batches: Sequence[Sequence[Sequence[int]]]) -> float:
    """Compiles the engine's program for every batch's shapes (warm-up, untimed); seconds.

    `lower().compile()` fills the same cache that `generate` reads; for shapes
    already compiled it returns at once."""
    start = time.perf_counter()
    for batch in batches:
        engine.lower(list(batch)).compile()
    return time.perf_counter() - start


@dataclasses.dataclass
class Run:
    tokens: list[list[int]]
    stats: dict[str, Any]
    seconds: float  # generation only, compilation excluded

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else float("nan")


def run(engine: specjax.Engine, ids: Sequence[Sequence[int]], batch_size: int, *, label: str = "",
        progress: bool = False, on_batch: Callable | None = None, warm: bool = True) -> Run:
    """Generates for every prompt, `batch_size` at a time; compilation first (untimed) when `warm`."""
    batches = chunks(list(ids), batch_size)
    if warm:
        seconds = compile_for(engine, batches)
        if progress:
            _cli.log(f"{label}compiled in {seconds:.1f}s")
    tokens, all_stats, total = [], [], 0.0
    for i, batch in enumerate(batches):
        what = f"{label}batch {i + 1}/{len(batches)}" if batch_size > 1 else f"{label}prompt {i + 1}/{len(batches)}"
        with _cli.Ticker(what) if progress else _cli.Null():
            start = time.perf_counter()
            out = engine.generate(list(batch))
            seconds = time.perf_counter() - start
        total += seconds
        tokens += out.tokens
        all_stats.append(out.stats)
        if progress:
            n = sum(len(t) for t in out.tokens)
            _cli.log(f"{what}: {n} tokens in {seconds:.2f}s ({n / seconds:.1f} tokens/s), tau {out.stats['tau']:.2f}")
        if on_batch is not None:
            on_batch(i, batch, out)
    return Run(tokens, metrics.merge(all_stats), total)
