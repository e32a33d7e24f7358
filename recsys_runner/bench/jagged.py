"""Jagged against padded attention (issue 32): ``hstu_rank``, DIN and BST trained by the runner on long-tailed histories,
each with ``model.attention=jagged`` and ``model.attention=padded``.

Histories follow a Zipf law capped at 512 events (``data=synthetic_sequences data.max_len=512 data.length_skew=1.2``),
cut into token batches (``data.batch_tokens``, drawn order): a batch holds a few long rows among many short ones, so the
padded block (rows × the longest row) is many times the tokens. Two figures per model:

* ``speed`` — the runner's ``train/tokens_per_s`` on the same in-memory batches, the two paths alternating over
  ``rounds`` rounds (medians of per-round ratios). Target: jagged ≥ 1.5× padded.
* ``memory`` — the peak RSS growth while training at two budgets (``B/2`` and ``B`` tokens), in a fresh process per
  variant (the peak mark reset after the build, as ``bench/sequences.py`` measures it; on CUDA
  ``max_memory_allocated``). The jagged path's growth should follow the tokens; the padded one's the padded slots.

``python -m recsys_runner.bench.jagged`` (in ``make bench``; ``--quick``: tiny sizes, memory measured in this process, to
check that it runs). docs/performance.md ("Jagged attention") holds the figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from recsys_runner.bench.regimes import COMMON, _Recorder, alternate, build_for_bench
from recsys_runner.bench.sequences import in_memory, made_batches, memory_child, peak_growth, runner_rates

MODELS = {"hstu_rank": ["model=hstu_rank", "model.embedding_dim=32", "model.num_layers=2", "model.dropout=0.0"],
          "din": ["model=din"], "bst": ["model=bst"]}
"""The models compared, at their sizes here (hstu_rank: the default's width and layers, no dropout; DIN and BST their
defaults)."""
ATTENTIONS = ("jagged", "padded")
SPEED_TARGET = 1.5
"""``tokens/s`` of the jagged path over the padded one."""


@dataclass(frozen=True)
class Settings:
    """The sizes of a run; :meth:`quick` only checks that it runs."""

    max_len: int = 512
    length_skew: float = 1.2
    batch_tokens: int = 4096
    steps: int = 20
    """Runner steps a round (windows of 10, the first dropped)."""
    rounds: int = 2
    distinct: int = 8
    """Distinct batches made per variant (cycled)."""
    memory_steps: int = 8

    @classmethod
    def quick(cls) -> Settings:
        return cls(max_len=64, batch_tokens=512, steps=20, rounds=1, distinct=2, memory_steps=2)

    def overrides(self, model: str, attention: str, tokens: int) -> list[str]:
        return [*MODELS[model], f"model.attention={attention}", "data=synthetic_sequences", f"data.max_len={self.max_len}",
                f"data.length_skew={self.length_skew}", f"data.batch_tokens={tokens}", *COMMON]

    def variant(self, tokens: int) -> str:
        return f"data.batch_tokens={tokens},data.group_by_length=false"


def bench_speed(model: str, s: Settings) -> dict[str, Any]:
    """The two paths' tokens/s on the same batches, alternating; their ratio."""
    loops, closers = {}, []
    for attention in ATTENTIONS:
        c = build_for_bench(s.overrides(model, attention, s.batch_tokens), s.steps)
        closers.append(c)
        loops[attention] = in_memory(c.loop, made_batches(c.loop, s.variant(s.batch_tokens), s.distinct, c.env.device))
    tokens: dict[str, list[float]] = {a: [] for a in ATTENTIONS}
    try:
        def rate(attention: str) -> float:
            samples, token_rate = runner_rates(loops[attention], s.steps)
            tokens[attention].append(token_rate)
            return samples

        samples = alternate(s.rounds, {a: functools.partial(rate, a) for a in ATTENTIONS}, f"{model} jagged/padded")
    finally:
        for c in closers:
            c.close()
    ratios = [j / p for j, p in zip(tokens["jagged"], tokens["padded"], strict=True)]
    return {"tokens_per_s": {a: statistics.median(tokens[a]) for a in ATTENTIONS},
            "samples_per_s": {a: statistics.median(samples[a]) for a in ATTENTIONS},
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios), "target": SPEED_TARGET,
            "met": statistics.median(ratios) >= SPEED_TARGET}


def measure_here(model: str, attention: str, tokens: int, s: Settings) -> dict[str, float]:
    """Peak memory growth (MB) while the runner trains ``s.memory_steps`` token batches of ``tokens``, in this process."""
    c = build_for_bench(s.overrides(model, attention, tokens), s.memory_steps)
    try:
        batches = made_batches(c.loop, s.variant(tokens), s.memory_steps, c.env.device)
        lengths = [b.sparse_features["hist_item_id"].lengths() for b in batches]
        stats = {"tokens": statistics.mean(float(x.sum()) for x in lengths),
                 "padded": statistics.mean(x.numel() * max(int(x.max()), 1) for x in lengths)}
        growth = peak_growth(replace(in_memory(c.loop, batches), tracker=_Recorder(), total_steps=s.memory_steps), c.env.device)
    finally:
        c.close()
    return {"growth_mb": growth, **stats}


def memory_growth(model: str, attention: str, tokens: int, s: Settings, fresh: bool) -> dict[str, float]:
    """:func:`measure_here` in a fresh process (``fresh``), else in this one."""
    if not fresh:
        return measure_here(model, attention, tokens, s)
    return memory_child([sys.executable, "-m", "recsys_runner.bench.jagged", "--memory", model, attention, str(tokens)])


def bench(s: Settings, fresh: bool, models: Sequence[str] = tuple(MODELS)) -> dict[str, Any]:
    out: dict[str, Any] = {"settings": s.__dict__, "models": {}}
    for model in models:
        speed = bench_speed(model, s)
        memory = {a: {str(t): memory_growth(model, a, t, s, fresh) for t in (s.batch_tokens // 2, s.batch_tokens)} for a in ATTENTIONS}
        out["models"][model] = {"speed": speed, "memory": memory}
        print(table_rows(model, speed, memory), flush=True)
    return out


def table_rows(model: str, speed: dict[str, Any], memory: dict[str, dict[str, dict[str, float]]]) -> str:
    t = speed["tokens_per_s"]
    lines = [f"{model}: tokens/s jagged {t['jagged']:,.0f}, padded {t['padded']:,.0f}: {speed['ratio']:.2f}x "
             f"(range {speed['ratio_min']:.2f}-{speed['ratio_max']:.2f}; target >= {SPEED_TARGET}: {'met' if speed['met'] else 'NOT met'})"]
    for attention, budgets in memory.items():
        for tokens, m in budgets.items():
            lines.append(f"  memory {attention:7s} batch_tokens={tokens:>6}: peak growth {m['growth_mb']:8.1f} MB for "
                         f"{m['tokens']:,.0f} tokens ({m['padded']:,.0f} padded slots)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, memory in this process: checks that it runs")
    parser.add_argument("--json", default="bench_results/jagged.json", help="where to write the results")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {','.join(MODELS)} (default: all)")
    parser.add_argument("--memory", nargs=3, metavar=("MODEL", "ATTENTION", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"--models {','.join(unknown)}: not benched here. Fix: pick from {','.join(MODELS)}")
    s = Settings.quick() if args.quick else Settings()
    if args.memory:
        model, attention, tokens = args.memory
        print(json.dumps(measure_here(model, attention, int(tokens), s)), flush=True)
        return None
    result = bench(s, fresh=not args.quick, models=models)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
