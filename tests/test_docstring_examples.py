"""STYLE.md rule 5: every model's and named part's ``Example::`` runs exactly as written.

Every docstring in ``recsys_runner/models`` that has an ``Example::`` block is collected here (a new model's too) and its
``>>>`` lines run with :mod:`doctest`, in a namespace of their own: an example imports what it uses, builds its data and
model (:func:`~recsys_runner.models.common.materialize` allocates the tables), calls the model and shows the output's
shape, which doctest compares. A class or function whose ``Example::`` has no ``>>>`` line fails: it would not be run.
A module docstring may show command lines under ``Example::`` instead (``python -m recsys_runner model=bst``).
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest
import torch

import recsys_runner.models

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
"""``...`` stands for any text in a shown output; runs of whitespace compare equal."""

MODULES = [info.name for info in pkgutil.iter_modules(recsys_runner.models.__path__, "recsys_runner.models.")]


def documented() -> list[doctest.DocTest]:
    """The docstrings of every module of ``recsys_runner.models`` with an ``Example::`` block or ``>>>`` lines, by name,
    but for a module docstring of command lines. Each starts from empty globals (``globs={}``): its own imports only."""
    finder = doctest.DocTestFinder(exclude_empty=False)
    found = [t for name in MODULES for t in finder.find(importlib.import_module(name), globs={})
             if t.examples or ("Example::" in (t.docstring or "") and t.name not in MODULES)]
    return sorted(found, key=lambda t: t.name)


EXAMPLES = documented()


def test_examples_are_collected() -> None:
    """The collection itself: the models' docstrings hold examples, so an empty list is a broken finder, not a pass."""
    assert {"recsys_runner.models.deepfm.DeepFM", "recsys_runner.models.din.TargetAttention"} <= {t.name for t in EXAMPLES}


@pytest.mark.parametrize("example", EXAMPLES, ids=[t.name.removeprefix("recsys_runner.models.") for t in EXAMPLES])
def test_example_runs_as_written(example: doctest.DocTest) -> None:
    assert example.examples, f"{example.name}: its Example:: block has no >>> lines, so it cannot be run as written"
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report: list[str] = []
    with torch.random.fork_rng(devices=[]):  # the examples draw random tensors; the tests after them keep their stream
        result = runner.run(example, out=report.append, clear_globs=True)
    assert result.failed == 0, f"{example.name}'s Example:: does not run as written:\n" + "".join(report)
