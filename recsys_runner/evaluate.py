"""``python -m recsys_runner.evaluate <overrides> load=<checkpoint>``: a checkpoint's eval metrics, as a new MLflow run.

Same overrides as the training run (they rebuild the same model and data), plus ``load``: a ``step_*``
checkpoint directory, a checkpoints root (best, else newest) or the training run's MLflow id. Change the
data to evaluate the checkpoint on other data, e.g. that day's ``data.eval_path=/data/day_31``; the
configured ``metrics.*`` are computed over all ranks (``torchrun --nproc_per_node=N -m recsys_runner.evaluate …``).
Data that keeps rows apart for this command is read as such (:meth:`~recsys_runner.data.base.DataConfig.for_evaluate`:
``data=criteo_npy data.last_day=holdout`` scores the last day's test half, where training evaluated on its val half).

The evaluation is the training loop's own (:class:`recsys_runner.train.evaluation.Evaluator`, over the model
:func:`recsys_runner.inference_build.build_inference` builds: no optimizer, schedule or train pipeline): the same
``train.eval_max_batches`` cap and, with
``train.ema.eval_with_ema``, the checkpoint's EMA weights, so on the same data and world size it reproduces
the training run's final eval metrics exactly. A checkpoint of another model config is refused, naming the
tensors that differ. The result is logged as ``eval/*`` at the checkpoint's step in a new MLflow run, a
child of the training run (:mod:`recsys_runner.inference`).
"""

from __future__ import annotations

import dataclasses
import logging

import hydra
from omegaconf import DictConfig

from recsys_runner.config import register_entry_schema, validate
from recsys_runner.data.encoding.stored import oov_line, oov_rates
from recsys_runner.inference import (
    LOAD_FIELD,
    carry_training_overrides,
    checkpoint_to_load,
    inference_start,
    with_training_overrides,
)
from recsys_runner.inference_build import build_inference
from recsys_runner.lifecycle import end_rank_process, exit_codes, one_job, tracked_run
from recsys_runner.noise import quiet_known_noise
from recsys_runner.overrides import check_command_line
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.progress import Progress
from recsys_runner.runtime import Launch

quiet_known_noise()  # the known library warnings, each with its reason (noise.py)
log = logging.getLogger("recsys_runner")
register_entry_schema("evaluate", [LOAD_FIELD])
"""The root schema of ``conf/evaluate.yaml``: the run's keys plus ``load``."""


@one_job
def run(cfg: DictConfig, launch: Launch = Launch()) -> dict[str, float]:
    """Evaluate the checkpoint ``cfg.load`` on the configured data; returns the eval metrics (every rank)."""
    checkpoint = checkpoint_to_load(cfg)  # first: a load= that names no checkpoint is the error to fix first
    spec = validate(cfg)
    if (scored := spec.data.for_evaluate()) is not spec.data:  # rows kept apart for evaluate (TorchRec's test half)
        spec = dataclasses.replace(spec, data=scored)
    built = build_inference(spec, launch=launch, weights=checkpoint)
    start = inference_start(built, entry="evaluate", checkpoint=checkpoint, load=str(cfg.load))
    with tracked_run(built.tracker, start, launch, close=built.close):
        with Progress(spec.train.eval_max_batches, enabled=built.env.is_main, unit="batch", desc="evaluate") as progress:
            assert built.evaluator is not None, "build_inference builds it unless evaluate=False"
            metrics = built.evaluator.evaluate(progress)
        built.tracker.log_metrics(metrics, built.state.step)
        if built.env.is_main:
            shown = " ".join(f"{k}={v:.6g}" for k, v in metrics.items())
            log.info("evaluate %s (step %d): %s", checkpoint, built.state.step, shown)
            if (line := oov_line(oov_rates(built.data.metrics()))) is not None:  # this rank's share of the eval data
                log.info("evaluate: %s", line)
        return metrics


@hydra.main(config_path=CONFIG_PATH, config_name="evaluate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    launch = Launch.from_hydra("recsys_runner.evaluate")  # Hydra's runtime, read here once and handed down
    with exit_codes(launch):  # a signal: the MLflow run KILLED, the command to redo it, exit 128 + signal (lifecycle.py)
        run(with_training_overrides(cfg, launch), launch)


if __name__ == "__main__":
    carry_training_overrides()  # before @hydra.main composes: the training's overrides, then this command's
    check_command_line("evaluate")  # a typo: one line with the closest valid name (overrides.py)
    main()
    end_rank_process()  # a rank of a multi-rank launch skips the native teardown (lifecycle.py says why)
