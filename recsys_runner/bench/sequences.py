"""Sequence regimes of ``make bench``: DIN through the runner vs a hand-written TorchRec loop, and token budgets vs rows.

Histories are long-tailed (``data=synthetic_sequences data.max_len=200 data.length_skew=1.0``: a Zipf law capped at
200, mean ~33 tokens a row), the case ``data.batch_tokens`` is for. docs/performance.md ("Sequences") says why each
regime matters and what was measured.

* ``e_din_in_memory`` — DIN's training step through the runner (:func:`recsys_runner.train.loop.train`, built by
  :func:`recsys_runner.build.build`: the real path) against TorchRec's loop written out by hand
  (:func:`~recsys_runner.bench.regimes.hand_written_model`: the same DIN on an ``EmbeddingCollection``, fused
  Adagrad, DMP with the runner's plan, gloo world size 1 on CPU), on the same token batches held in memory.
  samples/s of real rows; target ≥ 0.95.
* ``f_tokens_vs_rows`` — the runner on token batches against the same runner on fixed ``data.batch_size=B // (max_len
  + 1)`` batches: the row count whose *longest* rows fit the same ``B`` tokens, what one sets without a token budget.
  Token batches both in drawn order (``data.batch_tokens=B``) and grouped by length (``data.group_by_length=true``, at
  ``B`` and ``B/2``): DIN here pads each batch to its longest row (``model.attention=padded``, what these figures were
  measured with; its default since then runs on the jagged events, ``bench/jagged.py``), so only grouped batches keep the
  padded block near the tokens. tokens/s (``train/tokens_per_s``) ratio to the fixed rows, target ≥ 1.3; peak memory growth, target lower.
* ``g_memory_linear`` — peak memory growth of grouped token batches at ``B/4``, ``B/2`` and ``B``: linear in tokens
  means equal MB per 1k tokens between the points (a constant part, what every step allocates whatever its size,
  makes the growth itself less than double when the tokens double).

Memory is measured in a fresh process per variant (``python -m recsys_runner.bench.sequences --memory …``): after
the build and the batches are made, the kernel's peak-RSS mark is reset (``/proc/self/clear_refs``), the runner
trains the variant's batches, and the growth is ``VmHWM − VmRSS before the first step``. RSS, not ``tracemalloc``
(which does not see torch's allocations), with ``MALLOC_MMAP_THRESHOLD_`` fixed so that large tensors are mapped and
unmapped as they live and die instead of being kept by the allocator; on CUDA the growth is
``torch.cuda.max_memory_allocated`` over the same steps. It includes what the first steps allocate once (autograd and
kernel workspaces), alike for every variant.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torchrec.datasets.utils import Batch

from recsys_runner.bench.regimes import (
    COMMON,
    WINDOW,
    Regime,
    _Recorder,
    alternate,
    build_for_bench,
    hand_round,
    hand_written_model,
    on_device,
    with_data,
)
from recsys_runner.data.generated.synthetic_sequences import POOL_BATCHES, SyntheticSequences
from recsys_runner.data.memory import InMemoryData
from recsys_runner.train.loop import Loop, train

TOKENS_RATIO_TARGET = 1.3
"""``f_tokens_vs_rows``: tokens/s of the token-budget batches over the fixed-row batches."""
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
"""Memory children: tensors over 128 KiB always mmapped, so that freeing one returns it (glibc's threshold otherwise
rises with the largest freed block and the heap keeps it, hiding a later, larger peak)."""


@dataclass(frozen=True)
class Settings:
    """The sequence regimes' sizes; :meth:`quick` only checks that they run."""

    max_len: int = 200
    length_skew: float = 1.0
    batch_tokens: int = 8192
    steps: int = 30
    """Runner and hand-loop steps a round on token batches (windows of 10, the first dropped)."""
    fixed_steps: int = 100
    """Steps a round on the fixed-row batches (each ~6x cheaper, so a round takes about as long)."""
    rounds: int = 3
    distinct: int = POOL_BATCHES
    """Distinct batches made per variant (cycled; making a 200-long history batch costs about as much as a step):
    training batch indices ``0 …``, so that with ``group_by_length`` they are one whole pool, short rows to long."""
    memory_steps: int = POOL_BATCHES
    """Steps of a memory child, on batches ``0 …`` as above: the peak includes a pool's shortest-row (most rows) batch."""

    @classmethod
    def quick(cls) -> Settings:
        return cls(max_len=50, batch_tokens=1024, steps=20, fixed_steps=20, rounds=1, distinct=4, memory_steps=2)

    @property
    def fixed_rows(self) -> int:
        """The fixed batch whose longest rows fit ``batch_tokens``: ``batch_tokens // (max_len + 1)``."""
        return self.batch_tokens // (self.max_len + 1)

    def data(self) -> list[str]:
        return ["model=din", "model.attention=padded", "data=synthetic_sequences", f"data.max_len={self.max_len}",
                f"data.length_skew={self.length_skew}"]


def runner_rates(loop: Loop, steps: int) -> tuple[float, float]:
    """One runner round: the medians of its samples/s and tokens/s windows after the first."""
    recorder = _Recorder()
    train(replace(loop, tracker=recorder, total_steps=steps))
    return statistics.median(recorder.rates[1:]), statistics.median(recorder.token_rates[1:])


def made_batches(loop: Loop, variant: str, n: int, device: torch.device) -> list[Batch]:
    """``n`` batches of ``variant`` (comma-separated ``data.batch_tokens=…``, ``data.batch_size=…``,
    ``data.group_by_length=…``) made by the sequence data, on ``device``."""
    config = loop.data.config if isinstance(loop.data, SyntheticSequences) else None
    assert config is not None, "the sequence regimes draw their batches from data=synthetic_sequences"
    fields = dict(part.removeprefix("data.").split("=") for part in variant.split(","))
    data = replace(config, batch_tokens=int(fields["batch_tokens"]) if "batch_tokens" in fields else None,
                   batch_size=int(fields.get("batch_size", config.batch_size)),
                   group_by_length=fields.get("group_by_length") == "true").build(device="cpu")
    assert isinstance(data, SyntheticSequences)
    return on_device([data.batch(0, i) for i in range(n)], device)  # consecutive: with group_by_length, whole pools


def in_memory(loop: Loop, batches: list[Batch]) -> Loop:
    """``loop`` training on ``batches`` (cycled, one epoch each pass) and evaluating on the first."""
    return with_data(loop, InMemoryData(loop.data.features, batches, batches[:1]))


def variants(s: Settings) -> dict[str, str]:
    """The batchings compared: fixed rows, token batches in drawn order, token batches grouped by length at a quarter,
    half and the whole budget (the three points of (g))."""
    grouped = "data.group_by_length=true"
    return {"rows": f"data.batch_size={s.fixed_rows}", "tokens": f"data.batch_tokens={s.batch_tokens},data.group_by_length=false",
            "grouped_quarter": f"data.batch_tokens={s.batch_tokens // 4},{grouped}",
            "grouped_half": f"data.batch_tokens={s.batch_tokens // 2},{grouped}", "grouped": f"data.batch_tokens={s.batch_tokens},{grouped}"}


def bench_speed(overrides: list[str], s: Settings) -> tuple[Regime, dict[str, Any]]:
    """(e) runner vs hand loop on token batches, and (f)'s speed half: the runner on each batching of :func:`variants`."""
    c = build_for_bench([*s.data(), *COMMON, f"data.batch_tokens={s.batch_tokens}", *overrides], s.steps)
    try:
        made = {name: made_batches(c.loop, variant, s.distinct, c.env.device) for name, variant in variants(s).items()}
        loops = {name: in_memory(c.loop, batches) for name, batches in made.items()}
        steps = {name: s.fixed_steps if name == "rows" else s.steps for name in loops}
        hand_model, hand_opt = hand_written_model(c)
        seen: dict[str, list[tuple[float, float]]] = {name: [] for name in loops}

        def runner(name: str) -> float:
            seen[name].append(runner_rates(loops[name], steps[name]))
            return seen[name][-1][0]

        per_round = alternate(s.rounds, {"hand": lambda: hand_round(hand_model, hand_opt, made["tokens"], s.steps),
                                         **{name: functools.partial(runner, name) for name in loops}}, "e/f")
    finally:
        c.close()
    din = Regime.paired("e_din_in_memory", f"DIN, batch_tokens={s.batch_tokens}: runner vs hand-written EmbeddingCollection loop",
                        per_round["tokens"], per_round["hand"], {k: per_round[k] for k in ("tokens", "hand")})
    speed: dict[str, Any] = {}
    for name in loops:
        tokens = [t for _, t in seen[name]]
        ratios = [t / r for t, (_, r) in zip(tokens, seen["rows"], strict=True)]
        speed[name] = {"tokens_per_s": statistics.median(tokens), "samples_per_s": statistics.median(per_round[name]),
                       "ratio_to_rows": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                       "rows_per_batch": statistics.mean(int(b.labels.shape[0]) for b in made[name])}
    return din, speed


def memory_growth(batchings: Sequence[str], overrides: Sequence[str], s: Settings) -> dict[str, dict[str, float]]:
    """Peak memory growth (MB) while the runner trains ``s.memory_steps`` batches of each of ``batchings``, in turn, in
    one fresh process; keyed by batching."""
    cmd = [sys.executable, "-m", "recsys_runner.bench.sequences", *(a for b in batchings for a in ("--memory", b)),
           "--max-len", str(s.max_len), "--length-skew", str(s.length_skew), "--steps", str(s.memory_steps), *overrides]
    measured: dict[str, dict[str, float]] = memory_child(cmd)
    return measured


def memory_child(cmd: list[str]) -> Any:
    """Run a memory child ``cmd`` (with :data:`MEMORY_ENV`); the JSON object it printed last."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **MEMORY_ENV}, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def bench_memory(overrides: list[str], s: Settings, quick: bool = False) -> dict[str, dict[str, float]]:
    """(f)'s memory half and (g): peak growth of each batching of :func:`variants`, one fresh process each (with
    ``quick``, one process for all of them in turn: the plumbing is checked, not the figures, and four interpreter starts
    are saved)."""
    named = variants(s)
    groups = [list(named)] if quick else [[name] for name in named]
    out = {}
    for names in groups:
        measured = memory_growth([named[n] for n in names], overrides, s)
        for name in names:
            out[name] = measured[named[name]]
            print(f"memory {name} ({named[name]}): peak growth {out[name]['growth_mb']:.1f} MB; a step {out[name]['rows']:.0f} "
                  f"rows, {out[name]['tokens']:.0f} tokens, {out[name]['padded']:.0f} padded history slots", flush=True)
    return out


def _status(key: str) -> int:
    """A ``/proc/self/status`` field in kB."""
    with open("/proc/self/status") as f:
        match = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.MULTILINE)
    assert match, key
    return int(match.group(1))


def measure_here(variant: str, overrides: list[str], steps: int, s: Settings) -> dict[str, float]:
    """The ``--memory`` child: build, make ``steps`` batches of ``variant``, then train them with the peak marked."""
    c = build_for_bench([*s.data(), *COMMON, *variant.split(","), *overrides], steps)
    try:
        batches = made_batches(c.loop, variant, steps, c.env.device)
        lengths = [b.sparse_features["hist_item_id"].lengths() for b in batches]
        stats = {"tokens": statistics.mean(float(x.sum()) + x.numel() for x in lengths),
                 "padded": statistics.mean(x.numel() * max(int(x.max()), 1) for x in lengths),
                 "rows": statistics.mean(x.numel() for x in lengths)}
        growth = peak_growth(replace(in_memory(c.loop, batches), tracker=_Recorder(), total_steps=steps), c.env.device)
    finally:
        c.close()
    return {"growth_mb": growth, **stats}


def peak_growth(loop: Loop, device: torch.device) -> float:
    """Peak memory growth (MB) while ``loop`` trains: the kernel's peak-RSS mark reset first, or on CUDA
    ``max_memory_allocated`` over the same steps (module docstring)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        before = _status("VmRSS") * 1024
    train(loop)
    peak = torch.cuda.max_memory_allocated() if cuda else _status("VmHWM") * 1024
    return (peak - before) / 2**20


def table(din: Regime, speed: dict[str, Any], memory: dict[str, dict[str, float]], s: Settings) -> str:
    """The sequence rows printed under the main table: (e) as a regime row, then every batching's figures, then the verdicts."""
    mean = memory["tokens"]["tokens"] / memory["tokens"]["rows"]
    rows = [f"sequences: model=din data.max_len={s.max_len} data.length_skew={s.length_skew} (Zipf lengths, mean {mean:.1f} "
            f"tokens a row); in-memory batches, runner path",
            f"{din.name:<16} {din.runner_samples_per_s:>17,.0f} {din.reference_samples_per_s:>20,.0f} {din.ratio:>6.3f} "
            f"{din.ratio_min:>4.2f}-{din.ratio_max:<5.2f} {'>= ' + format(din.target, '.2f'):>8}   (samples/s of real rows)",
            f"{'batching':<42} {'rows':>6} {'tokens':>7} {'padded':>7} {'tokens/s':>9} {'vs rows':>16} {'peak MB':>8}"]
    for name, variant in variants(s).items():
        m, v = memory[name], speed.get(name)
        rate = f"{v['tokens_per_s']:>9,.0f} {v['ratio_to_rows']:>5.2f} ({v['ratio_min']:.2f}-{v['ratio_max']:.2f})" if v else f"{'':>26}"
        rows.append(f"{name + ' ' + variant:<42} {m['rows']:>6,.0f} {m['tokens']:>7,.0f} {m['padded']:>7,.0f} {rate} {m['growth_mb']:>8.1f}")
    for name in ("tokens", "grouped", "grouped_half", "grouped_quarter"):
        ratio, mb = speed[name]["ratio_to_rows"], memory[name]["growth_mb"]
        rows.append(f"f_tokens_vs_rows {name}: tokens/s {ratio:.2f}x rows ({'meets' if ratio >= TOKENS_RATIO_TARGET else 'misses'} "
                    f">= {TOKENS_RATIO_TARGET}); peak growth {mb:.1f} vs {memory['rows']['growth_mb']:.1f} MB "
                    f"({'lower' if mb < memory['rows']['growth_mb'] else 'NOT lower'})")
    points = [memory[n] for n in ("grouped_quarter", "grouped_half", "grouped")]
    slopes = [1000 * (b["growth_mb"] - a["growth_mb"]) / (b["tokens"] - a["tokens"]) for a, b in itertools.pairwise(points)]
    rows.append(f"g_memory_linear  grouped, batch_tokens {s.batch_tokens // 4} -> {s.batch_tokens // 2} -> {s.batch_tokens}: peak growth "
                + " -> ".join(f"{p['growth_mb']:.1f}" for p in points) + " MB; MB per 1k tokens " + ", ".join(f"{x:.2f}" for x in slopes)
                + f" (linear: equal slopes); x2 tokens -> x{points[2]['growth_mb'] / max(points[1]['growth_mb'], 1e-9):.2f} growth")
    return "\n".join(rows)


def bench_sequences(overrides: list[str], quick: bool, rounds: int | None = None) -> tuple[Regime, dict[str, Any], str]:
    """All sequence regimes: (e) as a :class:`Regime` row, (f)/(g) as a dict for the JSON, and their printed rows."""
    s = Settings.quick() if quick else Settings()
    if rounds is not None and not quick:
        s = replace(s, rounds=rounds)
    for name, n in (("steps", s.steps), ("fixed_steps", s.fixed_steps)):
        assert n >= 2 * WINDOW, f"{name} must cover a warm-up window and one more"
    din, speed = bench_speed(overrides, s)
    memory = bench_memory(overrides, s, quick)
    result = {"settings": s.__dict__ | {"fixed_rows": s.fixed_rows}, "variants": variants(s), "speed": speed, "memory": memory,
              "targets": {"tokens_ratio": TOKENS_RATIO_TARGET, "e_din_in_memory": din.target}}
    return din, result, table(din, speed, memory, s)


def main(argv: list[str] | None = None) -> None:
    """The ``--memory`` child process (one JSON line on stdout)."""
    parser = argparse.ArgumentParser(description="one memory measurement of the sequence regimes (run by the bench)")
    parser.add_argument("--memory", required=True, action="append",
                        help="a variant: data.batch_tokens=N or data.batch_size=N (repeatable: measured in turn)")
    parser.add_argument("--max-len", type=int, required=True)
    parser.add_argument("--length-skew", type=float, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    s = Settings(max_len=args.max_len, length_skew=args.length_skew)
    print(json.dumps({variant: measure_here(variant, args.overrides, args.steps, s) for variant in args.memory}), flush=True)


if __name__ == "__main__":
    main()
    # The measurement is printed; skip the interpreter's teardown, where a native thread of the closed process group
    # was seen to abort the process ("terminate called without an active exception") on a loaded machine.
    sys.stderr.flush()
    os._exit(0)
