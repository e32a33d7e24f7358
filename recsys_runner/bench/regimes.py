"""``make bench``: what the runner costs, against a minimal hand-written TorchRec loop, on the run's device.

Regimes (docs/performance.md says why each one matters):

* ``a_in_memory`` — the runner's training path (:func:`recsys_runner.train.loop.train`) against TorchRec's
  canonical loop written out by hand (:func:`hand_written_model`, :func:`hand_round`): same DeepFM, same
  seed, same sharding plan, fused Adagrad + dense Adagrad, on the same batches held in memory and
  already moved to the run's device (``distributed.device=auto``: CUDA when there is one): the first
  ``min(steps, 100)`` batches of the synthetic stream, which (b) makes on the fly. Target ≥ 0.97.
* ``b_synthetic`` / ``b_parquet`` — end to end through the real input paths, the same built model: the
  runner's own ``data=synthetic`` module, and ``data=parquet`` reading a generated Criteo-shaped file
  (:func:`recsys_runner.data.generated.generate.write_criteo_parquet`, ``learnable=False``). Each as samples/s and as a
  ratio to (a)'s in-memory runner figure. Target ≥ 0.9.
* ``c_host_overhead`` — (a)'s method on a tiny model and a small batch, where per-step host work
  (Python, bookkeeping, logging) is most of the step. Target ≥ 0.95.
* ``d_startup`` — seconds from launching ``python -m recsys_runner`` to its first finished step, split
  into importing torch + fbgemm_gpu + torchrec + the runner, and the rest (config, build, first step).

Every samples/s figure is the median of steady-state windows of 10 steps (the first window of each round
is warm-up and dropped). Paths alternate within a round and the order flips every round, so machine noise
hits all alike; a ratio is the median of the per-round ratios. Prints one table and writes it as JSON.

Usage: ``python -m recsys_runner.bench [--quick] [--json bench.json] [--rounds 7] [overrides…]`` (which also runs the
sequence regimes e-g of :mod:`recsys_runner.bench.sequences`; ``python -m recsys_runner.bench.regimes`` runs a-d only;
``python -m recsys_runner.bench --corpus [--help]`` runs the full-corpus evaluation regime alone, :mod:`recsys_runner.bench.corpus`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from recsys_runner.build import Components, build, build_model, seed_everything
from recsys_runner.config import RunConfig, register_configs, validate
from recsys_runner.data.base import DataModule
from recsys_runner.data.generated.generate import write_criteo_parquet
from recsys_runner.data.generated.synthetic import SyntheticData
from recsys_runner.data.memory import InMemoryData
from recsys_runner.models.train_wrapper import TrainWrapper
from recsys_runner.optim.optimizers import DenseAdagradConfig
from recsys_runner.optim.sparse import SparseAdagradConfig
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.tracking.tracker import NullTracker
from recsys_runner.train.loop import Loop, train

WINDOW = 10
"""Steps per timed window (``train.log_every_steps`` of the runner; one host sync per window in the hand loop)."""
MAX_DISTINCT_BATCHES = 100
"""Regimes (a)/(b) hold at most this many distinct batches in memory (on a GPU, 2.4 GB at batch 65536)."""

TARGETS = {"a_in_memory": 0.97, "b_synthetic": 0.9, "b_parquet": 0.9, "c_host_overhead": 0.95, "e_din_in_memory": 0.95}

COMMON = ["optim=adagrad", "tracking=none", "checkpoint=none", f"train.log_every_steps={WINDOW}",
          "train.eval_every_steps=null", "train.eval_max_batches=1", "train.progress=log"]
"""Overrides every regime shares: fused + dense Adagrad (what the hand loop writes out), nothing logged or saved, no
progress bar drawn between the bench's own lines (on a terminal; its per-step update is then a no-op, as in a batch job)."""

TINY = ["model=deepfm", "model.embedding_dim=4", "model.dense_arch_layer_sizes=[4]", "model.deep_layer_sizes=[8]",
        "data.batch_size=64", "data.num_sparse=4", "data.num_embeddings=1000"]
"""Regime (c): a model and batch so small that the step is mostly host work."""


class _Recorder(NullTracker):
    """A tracker that keeps the runner's samples/s (and, for data with histories, tokens/s) windows in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.rates: list[float] = []
        self.token_rates: list[float] = []

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if "train/samples_per_s" in metrics:
            self.rates.append(metrics["train/samples_per_s"])
        if "train/tokens_per_s" in metrics:
            self.token_rates.append(metrics["train/tokens_per_s"])


def with_data(loop: Loop, data: DataModule) -> Loop:
    """``loop`` training and evaluating on ``data`` instead (e.g. batches held in memory)."""
    return replace(loop, data=data, evaluator=replace(loop.evaluator, data=data))


MIN_STEPS = 2 * WINDOW
"""The fewest steps a timed round can take: its first window of :data:`WINDOW` steps is warm-up, and a median needs one more."""


def window_steps(text: str) -> int:
    """``argparse`` type of a bench's ``--steps``: a number of steps a timed round can take (at least :data:`MIN_STEPS`),
    refused at parsing, not as a ``StatisticsError`` from :func:`runner_round` after the model is built."""
    steps = int(text)
    if steps < MIN_STEPS:
        raise argparse.ArgumentTypeError(f"{steps} steps time no window: a round's first {WINDOW} steps are warm-up, and its "
                                         f"figure is the median of the windows after them. Fix: {MIN_STEPS} or more")
    return steps


def runner_round(loop: Loop, steps: int) -> float:
    """One call of the runner's :func:`train` for ``steps`` steps: median samples/s of its windows after the first."""
    if steps < MIN_STEPS:  # a bench's --steps is refused at parsing (window_steps): this names a caller's mistake
        raise ValueError(f"runner_round: {steps} steps leave no window after the warm-up one; at least {MIN_STEPS}")
    recorder = _Recorder()
    train(replace(loop, tracker=recorder, total_steps=steps))
    return statistics.median(recorder.rates[1:])


def hand_written_model(c: Components) -> tuple[DistributedModelParallel, torch.optim.Optimizer]:
    """TorchRec's canonical recipe, written out: EBC/EC on meta, fused Adagrad, DMP with the run's plan, dense Adagrad."""
    seed_everything(c.run.seed)
    sparse, dense_config = c.run.optim.sparse, c.run.optim.dense
    assert isinstance(sparse, SparseAdagradConfig) and isinstance(dense_config, DenseAdagradConfig), "the hand loop is written for optim=adagrad"
    model = TrainWrapper(build_model(c.run, c.loop.data.features, c.env.device))
    # DeepFM has two EBCs (embeddings, first order); a sequence model has an EC for its history tables (and maybe an EBC)
    for tables in (m for m in model.modules() if isinstance(m, EmbeddingBagCollection | EmbeddingCollection)):
        apply_optimizer_in_backward(torch.optim.Adagrad, tables.parameters(), {"lr": sparse.lr, "eps": sparse.eps})
    dmp = DistributedModelParallel(
        module=model, device=c.env.device, env=ShardingEnv.from_process_group(torch.distributed.GroupMember.WORLD),
        plan=c.plan, sharders=get_default_sharders(),
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=dense_config.lr, eps=dense_config.eps),
    )
    return dmp, dense


def hand_round(model: DistributedModelParallel, optimizer: torch.optim.Optimizer, batches: Sequence[Batch], steps: int) -> float:
    """The hand loop over ``batches`` (already on the model's device) for ``steps`` steps, timed as :func:`runner_round`
    (samples/s of the rows really trained: token batches hold varying rows)."""
    sizes = [int(b.labels.shape[0]) for b in batches]
    rates, rows, start = [], 0, time.perf_counter()
    for step in range(1, steps + 1):
        loss, _ = model(batches[(step - 1) % len(batches)])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        rows += sizes[(step - 1) % len(batches)]
        if step % WINDOW == 0:
            float(loss.detach())  # one host sync per window, as the runner's logging does
            now = time.perf_counter()
            rates.append(rows / (now - start))
            rows, start = 0, now
    return statistics.median(rates[1:])


def on_device(batches: Sequence[Batch], device: torch.device) -> list[Batch]:
    """``batches`` moved to ``device`` (the run's), so that neither path pays a host-to-device copy per step."""
    moved = [b.to(device) for b in batches]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return moved


def compose_run(overrides: Sequence[str]) -> RunConfig:
    """Compose ``overrides`` as the CLI does and validate them."""
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return validate(cfg)


def build_for_bench(overrides: list[str], steps: int) -> Components:
    """Compose ``overrides`` plus ``train.num_steps=<steps>`` as the CLI does, validate and build the run."""
    return build(compose_run([*overrides, f"train.num_steps={steps}"]))


def alternate(rounds: int, paths: Mapping[str, Callable[[], float]], label: str) -> dict[str, list[float]]:
    """Run every path once per round, in the given order on even rounds and reversed on odd ones."""
    names = list(paths)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            out[name].append(paths[name]())
        print(f"{label} round {r + 1}: " + "   ".join(f"{n} {out[n][-1]:,.0f}" for n in names) + " samples/s", flush=True)
    return out


@dataclass
class Regime:
    """One row of the table: the runner's figure, its reference, and the median of per-round ratios."""

    name: str
    what: str
    runner_samples_per_s: float
    reference_samples_per_s: float
    ratio: float
    target: float
    ratio_min: float
    ratio_max: float
    rounds: dict[str, list[float]] = field(default_factory=dict)

    @classmethod
    def paired(cls, name: str, what: str, runner: list[float], reference: list[float], rounds: dict[str, list[float]]) -> Regime:
        ratios = [x / y for x, y in zip(runner, reference, strict=True)]
        return cls(name, what, statistics.median(runner), statistics.median(reference), statistics.median(ratios), TARGETS[name],
                   min(ratios), max(ratios), rounds)


def time_to_first_step(overrides: Sequence[str], run_dir: str) -> float:
    """Seconds from launching ``python -m recsys_runner`` until it logs step 1."""
    cmd = [sys.executable, "-m", "recsys_runner", "tracking=none", "checkpoint=none", "train.num_steps=2", "train.log_every_steps=1",
           "train.eval_every_steps=null", "train.eval_max_batches=1", f"hydra.run.dir={run_dir}", *overrides]
    start = time.perf_counter()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if " - step 1/" in line:
                elapsed = time.perf_counter() - start
                proc.terminate()
                return elapsed
    raise RuntimeError(f"{' '.join(cmd)} never logged its first step")


def time_imports() -> float:
    """Seconds for a fresh interpreter to import the stack and the runner's build module (interpreter start included)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, fbgemm_gpu, torchrec, recsys_runner.build"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def bench_main_model(overrides: list[str], steps: int, rounds: int, parquet_rows: int, workdir: str) -> tuple[list[Regime], dict[str, Any]]:
    """Regimes (a) and (b): one built DeepFM; hand loop, runner in memory, runner on synthetic, runner on Parquet."""
    c = build_for_bench(["model=deepfm", *COMMON, *overrides], steps)
    try:
        data = c.loop.data
        info = {"device": str(c.env.device), "batch_size": data.batch_size, "pipeline": c.run.distributed.pipeline,
                "steps_per_round": steps, "rounds": rounds}
        # The very batches the synthetic round trains on, made beforehand: the paths differ only in when a batch is made.
        batches = on_device(list(itertools.islice(data.train_batches(0, 0, 1), min(steps, MAX_DISTINCT_BATCHES))), c.env.device)
        memory = with_data(c.loop, InMemoryData(data.features, batches, batches[:1]))
        # The same model fed from a Parquet file with the synthetic data's columns and id spaces.
        sizes = sorted({s.num_embeddings for s in data.features.sparse})
        assert len(sizes) == 1 and data.features.num_dense == 13 and len(data.features.sparse) == 26, \
            "regime (b) writes Criteo-shaped Parquet (13 dense, 26 sparse, one id-space size): keep data's shape"
        path = os.path.join(workdir, "criteo.parquet")
        write_criteo_parquet(path, parquet_rows, num_embeddings=sizes[0], learnable=False)
        run_parquet = compose_run(["model=deepfm", *COMMON, *overrides, "data=parquet", f"data.path={path}",
                                   f"data.batch_size={data.batch_size}", f"train.num_steps={steps}"])
        parquet_data = run_parquet.data.for_model(run_parquet.model.data_needs()).build()
        assert parquet_data.features == data.features, f"Parquet features {parquet_data.features} != {data.features}"
        parquet = with_data(c.loop, parquet_data)
        hand_model, hand_opt = hand_written_model(c)
        per_round = alternate(rounds, {
            "hand": lambda: hand_round(hand_model, hand_opt, batches, steps),
            "runner": lambda: runner_round(memory, steps),
            "synthetic": lambda: runner_round(c.loop, steps),
            "parquet": lambda: runner_round(parquet, steps),
        }, "a/b")
    finally:
        c.close()
    mem = per_round["runner"]
    regimes = [
        Regime.paired("a_in_memory", "runner training path vs hand-written TorchRec loop, same on-device batches",
                      mem, per_round["hand"], {k: per_round[k] for k in ("runner", "hand")}),
        Regime.paired("b_synthetic", "runner end to end, data=synthetic (the runner's data module) vs (a) in memory",
                      per_round["synthetic"], mem, {k: per_round[k] for k in ("synthetic", "runner")}),
        Regime.paired("b_parquet", f"runner end to end, data=parquet ({parquet_rows:,} rows) vs (a) in memory",
                      per_round["parquet"], mem, {k: per_round[k] for k in ("parquet", "runner")}),
    ]
    return regimes, info


def bench_host_overhead(overrides: list[str], steps: int, rounds: int) -> Regime:
    """Regime (c): (a)'s method on a tiny model and a batch of 64."""
    c = build_for_bench([*TINY, *COMMON, *overrides], steps)
    try:
        data = c.loop.data
        assert isinstance(data, SyntheticData), "regime (c) draws its batches from the synthetic data (data=synthetic, the default)"
        batches = on_device([data.batch(0, i) for i in range(WINDOW * 2)], c.env.device)
        memory = with_data(c.loop, InMemoryData(data.features, batches, batches[:1]))
        hand_model, hand_opt = hand_written_model(c)
        per_round = alternate(rounds, {
            "hand": lambda: hand_round(hand_model, hand_opt, batches, steps),
            "runner": lambda: runner_round(memory, steps),
        }, "c")
    finally:
        c.close()
    return Regime.paired("c_host_overhead", "tiny DeepFM (dim 4, 4 tables x 1000), batch 64: runner vs hand loop",
                         per_round["runner"], per_round["hand"], per_round)


def bench_startup(overrides: list[str], workdir: str, runs: int) -> dict[str, float]:
    """Regime (d): process start -> first step, and the import part of it; medians of ``runs`` (imports, run) pairs."""
    imports, totals = [], []
    for r in range(runs):
        imports.append(time_imports())
        totals.append(time_to_first_step(overrides, os.path.join(workdir, f"run{r}")))
        print(f"d run {r + 1}: imports {imports[-1]:.1f} s   process start -> first step {totals[-1]:.1f} s", flush=True)
    rest = statistics.median(t - i for t, i in zip(totals, imports, strict=True))
    return {"total_s": statistics.median(totals), "imports_s": statistics.median(imports), "rest_s": max(rest, 0.0)}


def table(regimes: Sequence[Regime], startup: Mapping[str, float]) -> str:
    rows = [f"{'regime':<16} {'runner samples/s':>17} {'reference samples/s':>20} {'ratio':>6} {'range':>10} {'target':>8}"]
    for r in regimes:
        rows.append(f"{r.name:<16} {r.runner_samples_per_s:>17,.0f} {r.reference_samples_per_s:>20,.0f} {r.ratio:>6.3f} "
                    f"{r.ratio_min:>4.2f}-{r.ratio_max:<5.2f} {'>= ' + format(r.target, '.2f'):>8}")
    rows.append(f"d_startup        process start -> first step {startup['total_s']:.1f} s = imports {startup['imports_s']:.1f} s "
                f"+ config/build/first step {startup['rest_s']:.1f} s")
    return "\n".join(rows)


SequenceBench = Callable[[list[str], bool, "int | None"], tuple[Regime, dict[str, Any], str]]
"""The sequence regimes (:func:`recsys_runner.bench.sequences.bench_sequences`): ``(overrides, quick, rounds)`` →
the DIN regime's row, the JSON of the others and their printed rows. Passed in by ``python -m recsys_runner.bench``,
since that module builds on this one's helpers (no import cycle)."""


def main(argv: list[str] | None = None, sequence_bench: SequenceBench | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=None, help="regimes (a)/(b)/(d) batch size (default 1024; --quick 128)")
    parser.add_argument("--steps", type=window_steps, default=None, help="steps per round for (a)/(b), windows of 10 (default 100; --quick 20)")
    parser.add_argument("--host-steps", type=window_steps, default=None, help="steps per round for (c) (default 300; --quick 20)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 7; --quick 1)")
    parser.add_argument("--parquet-rows", type=int, default=None, help="rows of the generated Parquet file (default 200000)")
    parser.add_argument("--json", default="bench_results/bench.json", help="where to write the results (default ./bench_results/bench.json, git-ignored)")
    parser.add_argument("--startup-runs", type=int, default=None, help="launches timed for (d) (default 3; --quick 1)")
    parser.add_argument("--quick", action="store_true", help="tiny steps and one round: checks that every regime runs, not how fast")
    parser.add_argument("--skip", action="append", default=[], choices=["ab", "c", "d", "seq"],
                        help="leave out regimes (repeatable); seq: the sequence regimes e-g (bench/sequences.py)")
    parser.add_argument("overrides", nargs="*", help="extra config overrides for every regime (e.g. distributed.device=cuda)")
    args = parser.parse_args(argv)
    q = args.quick
    batch_size = args.batch_size or (128 if q else 1024)
    steps = args.steps or (20 if q else 100)
    host_steps = args.host_steps or (20 if q else 300)
    rounds = args.rounds or (1 if q else 7)
    parquet_rows = args.parquet_rows or (20_000 if q else 200_000)
    os.makedirs(os.path.dirname(str(args.json)) or ".", exist_ok=True)  # only once the arguments are accepted

    started = time.perf_counter()
    regimes: list[Regime] = []
    info: dict[str, Any] = {}
    startup: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="recsys_bench_") as workdir:
        if "ab" not in args.skip:
            ab, info = bench_main_model([f"data.batch_size={batch_size}", *args.overrides], steps, rounds, parquet_rows, workdir)
            regimes += ab
        if "c" not in args.skip:
            regimes.append(bench_host_overhead(args.overrides, host_steps, rounds))
        if "d" not in args.skip:
            startup = bench_startup([f"data.batch_size={batch_size}", *args.overrides], workdir, args.startup_runs or (1 if q else 3))
    sequences: dict[str, Any] = {}
    sequence_rows = ""
    if sequence_bench is not None and "seq" not in args.skip:
        din, sequences, sequence_rows = sequence_bench(args.overrides, q, args.rounds)
        regimes.append(din)
    result = {
        "device": info.get("device", "cpu" if not torch.cuda.is_available() else "cuda"),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "batch_size": batch_size, "steps_per_round": steps,
        "host_steps_per_round": host_steps, "rounds": rounds, "quick": q, "overrides": args.overrides,
        "regimes": {r.name: asdict(r) for r in regimes}, "startup": startup, "sequences": sequences,
        "bench_seconds": time.perf_counter() - started,
    }
    report(result, regimes, sequence_rows, args.json)
    return result


def report(result: Mapping[str, Any], regimes: Sequence[Regime], sequence_rows: str, path: str) -> None:
    """Print the table (the sequence regimes' rows under it) and write ``result`` as JSON to ``path``."""
    print()
    print(f"device={result['device']} threads={result['threads']} batch={result['batch_size']} "
          f"steps/round={result['steps_per_round']} rounds={result['rounds']} (ratios: median of per-round ratios)")
    plain = [r for r in regimes if r.name != "e_din_in_memory"]  # printed with the sequence rows
    startup = result["startup"]
    if plain or startup:
        print(table(plain, startup) if startup else table(plain, {"total_s": 0.0, "imports_s": 0.0, "rest_s": 0.0}))
    if sequence_rows:
        print(sequence_rows)
    print(f"bench took {result['bench_seconds']:.0f} s; results in {path}")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
