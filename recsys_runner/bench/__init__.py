"""Benchmarks (``make bench``): the runner against a hand-written TorchRec loop, end to end and per step.

``regimes`` runs the regimes (a)-(d) and prints one table; ``data`` looks closer at the Parquet reader;
``summaries`` times what ``train.summary_every_steps`` costs; ``step_options``, ``breakdown`` and ``caching`` measure
the GPU step (its options, where its time goes, tables larger than the GPU), and ``gpu`` runs every GPU measurement.
May import anything in the package (it drives whole runs); nothing in the package imports it.
"""

import json
import os
from typing import Any

from recsys_runner.noise import quiet_known_noise

quiet_known_noise()  # the known library warnings, filtered as every entry point filters them (noise.py): a bench prints its table


def write_results(path: str, result: dict[str, Any]) -> None:
    """Write a bench's ``result`` as JSON to ``path`` (its folder made, e.g. the git-ignored ``bench_results/``) and say where."""
    os.makedirs(os.path.dirname(str(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"results in {path}")
