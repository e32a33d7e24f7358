"""``make bench``: the runner's training path against a minimal hand-written TorchRec loop.

Both train the same DeepFM (same seed, same sharding plan, same fused Adagrad + dense Adagrad)
on the same in-memory Criteo-shaped batches, in one process, alternating rounds so that machine
noise hits both alike. Reported: steady-state samples/s of each (median over timed windows, the
first window of each round discarded as warm-up), the median of the per-round ratios (the target is
≥ 0.97), and the
seconds from process start to the first finished training step of ``python -m recsys_runner``.

Usage: ``python -m recsys_runner.bench [--batch-size 2048] [--steps 60] [--rounds 3] [overrides…]``
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import replace

import torch
from hydra import compose, initialize_config_dir
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from recsys_runner.build import Components, build, seed_everything
from recsys_runner.config import register_configs, validate
from recsys_runner.data import DataModule
from recsys_runner.data.memory import InMemoryData
from recsys_runner.models.common import TrainWrapper
from recsys_runner.optim import DenseAdagradConfig, SparseAdagradConfig
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.runner import Loop, train

WINDOW = 10


class _Recorder:
    """A tracker that keeps the runner's samples/s windows in memory."""

    run_id: str | None = None

    def __init__(self) -> None:
        self.rates: list[float] = []

    def check(self) -> None: ...
    def start(self, **_: object) -> None: ...
    def resume(self, run_id: str) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def set_tag(self, key: str, value: str) -> None: ...
    def finish(self, status: str) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if "train/samples_per_s" in metrics:
            self.rates.append(metrics["train/samples_per_s"])


def with_data(loop: Loop, data: DataModule) -> Loop:
    """``loop`` training and evaluating on ``data`` instead (e.g. batches held in memory)."""
    return replace(loop, data=data, evaluator=replace(loop.evaluator, data=data))


def runner_round(loop: Loop, steps: int) -> float:
    recorder = _Recorder()
    train(replace(loop, tracker=recorder, total_steps=steps))
    return statistics.median(recorder.rates[1:])


def hand_written_model(c: Components) -> tuple[DistributedModelParallel, torch.optim.Optimizer]:
    """TorchRec's canonical recipe, written out: EBC on meta, fused Adagrad, DMP, dense Adagrad."""
    seed_everything(c.run.seed)
    sparse, dense_config = c.run.optim.sparse, c.run.optim.dense
    assert isinstance(sparse, SparseAdagradConfig) and isinstance(dense_config, DenseAdagradConfig), "the hand loop is written for optim=adagrad"
    model = TrainWrapper(c.run.model.build(features=c.loop.data.features, dense_device=c.env.device))
    ebc = model.model.get_submodule("sparse_arch.ebc")
    apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": sparse.lr, "eps": sparse.eps})
    dmp = DistributedModelParallel(
        module=model, device=c.env.device, env=ShardingEnv.from_process_group(torch.distributed.GroupMember.WORLD),
        plan=c.plan, sharders=get_default_sharders(),
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=dense_config.lr, eps=dense_config.eps),
    )
    return dmp, dense


def hand_round(model: DistributedModelParallel, optimizer: torch.optim.Optimizer, batches: list, steps: int, batch_size: int) -> float:
    rates, start = [], time.perf_counter()
    for step in range(1, steps + 1):
        loss, _ = model(batches[(step - 1) % len(batches)])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % WINDOW == 0:
            float(loss.detach())  # one sync per window, as the runner's logging does
            now = time.perf_counter()
            rates.append(WINDOW * batch_size / (now - start))
            start = now
    return statistics.median(rates[1:])


def time_to_first_step(overrides: list[str]) -> float:
    """Seconds from launching ``python -m recsys_runner`` until it logs step 1."""
    cmd = [sys.executable, "-m", "recsys_runner", "tracking=none", "train.num_steps=2", "train.log_every_steps=1",
           "train.eval_every_steps=null", "train.eval_max_batches=1", *overrides]
    start = time.perf_counter()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if " - step 1/" in line:
                elapsed = time.perf_counter() - start
                proc.terminate()
                return elapsed
    raise RuntimeError(f"{' '.join(cmd)} never logged its first step")


def build_for_bench(overrides: list[str], steps: int) -> Components:
    """Compose ``overrides`` plus ``train.num_steps=<steps>`` as the CLI does, validate and build the run."""
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides, f"train.num_steps={steps}"])
    return build(validate(cfg))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=50, help="steps per round (windows of 10)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("overrides", nargs="*", help="extra config overrides for both paths")
    args = parser.parse_args(argv)
    overrides = ["model=deepfm", "optim=adagrad", "tracking=none", f"data.batch_size={args.batch_size}",
                 f"train.log_every_steps={WINDOW}", "train.eval_every_steps=null", "train.eval_max_batches=1", *args.overrides]

    c = build_for_bench(overrides, args.steps)
    try:
        data = c.loop.data
        batches = [data.batch(0, i) for i in range(WINDOW * 2)]  # type: ignore[attr-defined]
        loop = with_data(c.loop, InMemoryData(data.features, batches, batches[:1]))
        hand_model, hand_opt = hand_written_model(c)
        hand, runner = [], []
        for r in range(args.rounds):
            # Alternate which path goes first so that neither always inherits a warm (or a hot) CPU.
            if r % 2 == 0:
                hand.append(hand_round(hand_model, hand_opt, batches, args.steps, args.batch_size))
                runner.append(runner_round(loop, args.steps))
            else:
                runner.append(runner_round(loop, args.steps))
                hand.append(hand_round(hand_model, hand_opt, batches, args.steps, args.batch_size))
            print(f"round {r + 1}: hand-written {hand[-1]:,.0f} samples/s   runner {runner[-1]:,.0f} samples/s", flush=True)
    finally:
        c.close()
    startup = time_to_first_step([f"data.batch_size={args.batch_size}", *args.overrides])
    h, rr = statistics.median(hand), statistics.median(runner)
    # Adjacent rounds share the machine's state, so the median of per-round ratios is steadier
    # than the ratio of medians on a busy 2-core box.
    ratios = [r / x for r, x in zip(runner, hand, strict=True)]
    ratio = statistics.median(ratios)
    print()
    print(f"model=deepfm batch={args.batch_size} threads={torch.get_num_threads()} pipeline={c.run.distributed.pipeline}")
    print(f"hand-written TorchRec loop : {h:,.0f} samples/s")
    print(f"recsys_runner training path: {rr:,.0f} samples/s")
    print(f"ratio runner / hand-written: {ratio:.3f}  (median of per-round ratios, range {min(ratios):.2f}-{max(ratios):.2f}; target >= 0.97)")
    print(f"process start -> first step: {startup:.1f} s")


if __name__ == "__main__":
    main()
