"""Where ``export`` writes: ``export.dir`` (default ``<Hydra run dir>/export``), refused when it holds anything but an
earlier export, and replaced as a whole — the new export is staged (:class:`recsys_runner.staging.StagedFolder`) and moved
into place only when complete, so the directory holds one whole export or none (docs/export.md, "The output is all or
nothing")."""

from __future__ import annotations

from pathlib import Path

from recsys_runner import uris
from recsys_runner.errors import ConfigError
from recsys_runner.runtime import Launch
from recsys_runner.serving import mlflow_model
from recsys_runner.serving.files import EXAMPLE_FILE, FEATURE_SPEC_FILE, ITEMS_FILE, MODEL_FILE, TOWER_FILE
from recsys_runner.staging import check_writable, held_names, is_local_file
from recsys_runner.tracking import lineage


def export_dir(configured: str | None, launch: Launch) -> Path:
    """``export.dir``, else ``<Hydra run dir>/export``."""
    if configured is not None:
        return uris.as_path(configured)
    default = launch.under_output_dir("export")
    if default is None:
        raise ConfigError("export.dir is not set and this is not a Hydra run. Fix: export.dir=<directory>")
    return default


def is_export_file(name: str) -> bool:
    """Whether ``name`` is a file (or MLflow model directory) an export writes (what ``export.overwrite=true`` may replace)."""
    return (name in (MODEL_FILE, FEATURE_SPEC_FILE, EXAMPLE_FILE, ITEMS_FILE, lineage.MANIFEST_FILE, mlflow_model.MODEL_DIR)
            or name.endswith(TOWER_FILE.format("")) or (name.startswith("mlflow_") and name.endswith("_tower")))


def check_target(out: Path, overwrite: bool) -> None:
    """Refuse an ``export.dir`` that is a file, that cannot be written (:func:`check_writable`), or a non-empty directory
    unless ``overwrite`` (and then only one holding nothing but an earlier export's files); called before any model is built.

    Raises:
        ConfigError: naming the directory, what it holds and the fix.
    """
    held = held_names(out, f"export.dir={out}")
    check_writable(out, f"export.dir={out}", "another export.dir")
    if not held:
        return
    shown = held[:8] + ([f"… {len(held) - 8} more"] if len(held) > 8 else [])
    if not overwrite:
        raise ConfigError(f"export.dir={out} is not empty (it holds {shown}): an earlier export's files would be overwritten or "
                          f"mixed with this one's. Fix: export.overwrite=true to replace them, or a new export.dir")
    foreign = [n for n in held if not (is_export_file(n) and (is_local_file(out, n) or n.startswith("mlflow_")))]
    if foreign:
        raise ConfigError(f"export.dir={out} holds {foreign[:8]}, which no export writes; export.overwrite=true replaces only an "
                          f"earlier export's files. Fix: a new export.dir, or move those away")
