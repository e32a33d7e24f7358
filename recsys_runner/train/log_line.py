"""What a ``step N/M`` log line and the progress bar show of a step's metrics; the tracker gets every one.

Apart from :mod:`recsys_runner.train.loop` because it is a matter of reading, not of training: on Criteo's 26
vocabularies a line held every per-column OOV rate and the data counters at 0, ~1,600 characters that buried the loss.
"""

from __future__ import annotations

from recsys_runner.data.encoding.stored import RATE_PREFIX

LINE_RATES = 3
"""Per-column OOV rates a ``step N/M`` line shows: the highest (the tracker gets every one)."""


def in_the_line(metrics: dict[str, float]) -> dict[str, float]:
    """What a ``step N/M`` line shows of ``metrics``; the tracker gets them all. A data counter at 0 (bad rows skipped, rows
    dropped to even the ranks, histories cut) is left out, and of the per-column OOV rates the :data:`LINE_RATES` highest
    above 0: on Criteo's 26 vocabularies every line held 26 rates and three zero counters, ~1,600 characters that buried
    the loss (:func:`line_extra` says how many rates the line leaves to the tracker)."""
    rates = sorted(((v, k) for k, v in metrics.items() if k.startswith(RATE_PREFIX) and v > 0), reverse=True)[:LINE_RATES]
    shown = {k for _, k in rates}
    return {k: v for k, v in metrics.items()
            if k != "train/eta_s" and (k in shown or not (k.startswith(RATE_PREFIX) or (k.startswith("data/") and v == 0)))}


def line_extra(metrics: dict[str, float]) -> str:
    """How many per-column OOV rates a ``step N/M`` line leaves out (:func:`in_the_line`), e.g. `` (+23 lower
    data/oov_rate/<column> in the run's metrics)``; ``""`` when it shows them all."""
    left = sum(1 for k in metrics if k.startswith(RATE_PREFIX)) - sum(1 for k in in_the_line(metrics) if k.startswith(RATE_PREFIX))
    return f" (+{left} lower {RATE_PREFIX}<column> in the run's metrics)" if left else ""


def on_the_bar(metrics: dict[str, float]) -> dict[str, float]:
    """What the bar shows after its own step/total, rate and ETA: loss, samples/s and the latest eval metrics."""
    shown = {"loss": metrics.get("train/loss"), "samples/s": metrics.get("train/samples_per_s")}
    shown |= {k.removeprefix("eval/"): v for k, v in metrics.items() if k.startswith("eval/")}
    return {k: v for k, v in shown.items() if v is not None}
