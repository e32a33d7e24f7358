"""Metrics, a module per concern: math (``functional``), classes by family (``classification``, ``regression``, ``retrieval``, ``decay``), names → classes and direction (``registry``), per-task wiring (``tasks``), the base with its cross-rank states (``state``), AUC and grouped AUC over ranks by routing rows rather than gathering them (``sharded``).

May import ``recsys_runner.tasks``, ``features``, ``errors``, ``configurable``; never ``models``, ``train``, ``checkpoint``, ``tracking``, ``build``, ``config``. No re-exports: import from the defining module.
"""
