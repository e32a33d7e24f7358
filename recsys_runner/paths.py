"""Where ``conf/`` is found.

In a checkout (editable install or ``python -m`` from the repo root) the top-level ``conf/``
directory beside the package is used, so edits to YAML take effect immediately. A wheel ships the
same files as the package ``recsys_runner.conf`` (see ``pyproject.toml``), found via ``pkg://``.
"""

from __future__ import annotations

from pathlib import Path

_CHECKOUT_CONF = Path(__file__).resolve().parent.parent / "conf"

CONFIG_PATH: str = str(_CHECKOUT_CONF) if (_CHECKOUT_CONF / "config.yaml").is_file() else "pkg://recsys_runner.conf"
