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

``evaluate.importance=permutation`` adds which features carry those metrics: one more pass per input feature, with
that feature's values shuffled across each batch's rows (:mod:`recsys_runner.importance`); a table of each metric's
change (AUC drop, log loss rise; a ranking model's HR@k/NDCG@k/recall@k/MRR drops, its query side only) per feature,
most important first, printed, written to the run directory as ``importance.csv``/``importance.json``, and logged as
those artifacts and ``importance/<feature>/<metric>_drop|_rise``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import hydra
from omegaconf import DictConfig, OmegaConf

from recsys_runner import importance
from recsys_runner.collection import skip_the_exit_collection
from recsys_runner.config import register_entry_schema, validate
from recsys_runner.data.encoding.stored import oov_line, oov_rates
from recsys_runner.errors import ConfigError, require
from recsys_runner.inference import (
    LOAD_FIELD,
    carry_training_overrides,
    checkpoint_to_load,
    inference_start,
    with_training_overrides,
)
from recsys_runner.inference_build import Inference, build_inference
from recsys_runner.lifecycle import end_rank_process, exit_codes, one_job, tracked_run
from recsys_runner.noise import quiet_known_noise
from recsys_runner.overrides import check_command_line
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.progress import Progress
from recsys_runner.runtime import Launch

quiet_known_noise()  # the known library warnings, each with its reason (noise.py)
log = logging.getLogger("recsys_runner")
IMPORTANCE_METHODS = ("none", "permutation")


@dataclass(kw_only=True)
class EvaluateConfig:
    """The ``evaluate`` section of ``conf/evaluate.yaml``."""

    importance: str = "none"
    """``permutation``: after the metrics, each input feature's importance (:mod:`recsys_runner.importance`): the eval
    pass again per feature with its values shuffled across each batch's rows, and each metric's change; ``none``: the
    metrics only. Costs one eval pass per feature measured (``train.eval_max_batches`` caps each)."""
    importance_features: list[str] = field(default_factory=list)
    """The features to measure (dense columns, sparse features, history groups by name); empty: every one."""
    importance_seed: int = 0
    """Seeds the shuffles: the same seed gives the same numbers on the same data and ranks."""

    def __post_init__(self) -> None:
        require(self.importance in IMPORTANCE_METHODS,
                f"evaluate.importance={self.importance!r} must be one of {list(IMPORTANCE_METHODS)}")
        require(not self.importance_features or self.importance == "permutation",
                f"evaluate.importance_features={self.importance_features} is set, but evaluate.importance=none measures "
                f"nothing. Fix: add evaluate.importance=permutation")
        twice = sorted({f for f in self.importance_features if self.importance_features.count(f) > 1})
        require(not twice, f"evaluate.importance_features names {twice} twice")


register_entry_schema("evaluate", [LOAD_FIELD, ("evaluate", EvaluateConfig, field(default_factory=EvaluateConfig))])
"""The root schema of ``conf/evaluate.yaml``: the run's keys plus ``load`` and ``evaluate.*``."""


@one_job
def run(cfg: DictConfig, launch: Launch = Launch()) -> dict[str, float]:
    """Evaluate the checkpoint ``cfg.load`` on the configured data; returns the eval metrics (every rank)."""
    checkpoint = checkpoint_to_load(cfg)  # first: a load= that names no checkpoint is the error to fix first
    spec = validate(cfg)
    settings = settings_of(cfg)
    if (scored := spec.data.for_evaluate()) is not spec.data:  # rows kept apart for evaluate (TorchRec's test half)
        spec = replace(spec, data=scored)
    built = build_inference(spec, launch=launch, weights=checkpoint)
    params = {f"evaluate.{k}": v for k, v in vars(settings).items()} if settings.importance != "none" else None
    start = inference_start(built, entry="evaluate", checkpoint=checkpoint, load=str(cfg.load), extra_params=params)
    with tracked_run(built.tracker, start, launch, close=built.close):
        measured = measured_features(built, settings)  # before the first pass: a name that is no feature is refused now
        with Progress(spec.train.eval_max_batches, enabled=built.env.is_main, unit="batch", desc="evaluate") as progress:
            assert built.evaluator is not None, "build_inference builds it unless evaluate=False"
            metrics = built.evaluator.evaluate(progress)
        built.tracker.log_metrics(metrics, built.state.step)
        if built.env.is_main:
            shown = " ".join(f"{k}={v:.6g}" for k, v in metrics.items())
            log.info("evaluate %s (step %d): %s", checkpoint, built.state.step, shown)
            if (line := oov_line(oov_rates(built.data.metrics()))) is not None:  # this rank's share of the eval data
                log.info("evaluate: %s", line)
        if measured:
            feature_importance(built, measured, settings.importance_seed, metrics, launch)
        return metrics


def measured_features(built: Inference, settings: EvaluateConfig) -> list[importance.Feature]:
    """The features whose importance ``settings`` asks for (none with ``evaluate.importance=none``), its cost said."""
    if settings.importance == "none":
        return []
    item = importance.item_side(built.model, built.tasks, built.data.features)
    features = importance.selected(importance.input_features(built.data.features), settings.importance_features, item)
    if item and built.env.is_main:
        log.info("evaluate.importance=permutation: this model ranks items; its item side is never shuffled: %s",
                 ", ".join(sorted(item)))
    if built.env.is_main:
        cap = built.evaluator.max_batches if built.evaluator is not None else None
        log.info("evaluate.importance=permutation: %d feature(s), so %d eval passes (the metrics, then one per feature "
                 "shuffled), each over %s: %s", len(features), len(features) + 1,
                 "every eval batch" if cap is None else f"at most {cap} eval batches per rank (train.eval_max_batches)",
                 ", ".join(f.name for f in features))
    return features


def feature_importance(built: Inference, features: list[importance.Feature], seed: int, base: dict[str, float],
                       launch: Launch) -> None:
    """The permutation importance of ``features`` against the ``base`` metrics: measured (every rank), then printed,
    written to the run directory and logged to the run (rank 0)."""
    assert built.evaluator is not None
    rows = importance.ranked(base, importance.measure(built.evaluator, features, seed=seed, show=built.env.is_main))
    if not built.env.is_main:
        return
    log.info("feature importance (each metric's change with the feature shuffled; > 0: the feature helps):\n%s",
             importance.table(base, rows))
    directory = launch.output_dir
    for name, text in importance.write(directory, base, rows, seed).items():
        built.tracker.log_text(text, name)
    built.tracker.log_metrics(importance.metric_keys(rows), built.state.step)
    if directory is not None:
        log.info("feature importance written to %s", directory / f"{importance.IMPORTANCE_FILE}.csv")


def settings_of(cfg: DictConfig) -> EvaluateConfig:
    """``cfg.evaluate`` as a validated :class:`EvaluateConfig` (its ``__post_init__`` run)."""
    try:
        settings = OmegaConf.to_object(cfg.evaluate)
    except Exception as e:  # OmegaConf wraps the ConfigError raised in __post_init__
        if isinstance(e.__cause__, ConfigError):
            raise e.__cause__ from None
        raise
    assert isinstance(settings, EvaluateConfig)
    return settings


@hydra.main(config_path=CONFIG_PATH, config_name="evaluate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    launch = Launch.from_hydra("recsys_runner.evaluate")  # Hydra's runtime, read here once and handed down
    with exit_codes(launch):  # a signal: the MLflow run KILLED, the command to redo it, exit 128 + signal (lifecycle.py)
        run(with_training_overrides(cfg, launch), launch)


if __name__ == "__main__":
    skip_the_exit_collection()  # the exit skips collecting what the command left (collection.py says why)
    carry_training_overrides()  # before @hydra.main composes: the training's overrides, then this command's
    check_command_line("evaluate")  # a typo: one line with the closest valid name (overrides.py)
    main()
    end_rank_process()  # a rank of a multi-rank launch skips the native teardown (lifecycle.py says why)
