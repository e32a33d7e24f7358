"""STYLE.md rule 5: every model's and named part's ``Example::`` runs exactly as written.

Every docstring in ``recsys_runner/models`` that has an ``Example::`` block is collected here (a new model's too) and its
``>>>`` lines run with :mod:`doctest`, in a namespace of their own: an example imports what it uses, builds its data and
model (:func:`~recsys_runner.models.common.materialize` allocates the tables), calls the model and shows the output's
shape, which doctest compares. A class or function whose ``Example::`` has no ``>>>`` line fails: it would not be run.
Module docstrings may show command lines under ``Example::`` instead (``python -m recsys_runner model=bst``).
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import recsys_runner.models

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


MODULES = [info.name for info in pkgutil.iter_modules(recsys_runner.models.__path__, "recsys_runner.models.")]


def documented() -> list[doctest.DocTest]:
    """The docstrings with an ``Example::`` block in every module of ``recsys_runner.models``, by name."""
    finder = doctest.DocTestFinder(exclude_empty=False)
    found = [t for name in MODULES for t in finder.find(importlib.import_module(name), globs={})
             if "Example::" in (t.docstring or "")]
    return sorted(found, key=lambda t: t.name)


EXAMPLES = documented()


def test_examples_are_collected() -> None:
    """The collection itself: the models' docstrings hold examples, so an empty list is a broken finder, not a pass."""
    assert {"recsys_runner.models.deepfm.DeepFM", "recsys_runner.models.din.TargetAttention"} <= {t.name for t in EXAMPLES}


@pytest.mark.parametrize("example", EXAMPLES, ids=[t.name.removeprefix("recsys_runner.models.") for t in EXAMPLES])
def test_example_runs_as_written(example: doctest.DocTest) -> None:
    if not example.examples:
        assert example.name in MODULES, f"{example.name}: its Example:: block has no >>> lines, so it cannot be run as written"
        return
    example.globs = {}  # its own imports only: nothing of this module or of the models' module leaks in
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report: list[str] = []
    result = runner.run(example, out=report.append, clear_globs=True)
    assert result.failed == 0, f"{example.name}'s Example:: does not run as written:\n" + "".join(report)
