"""``python -m recsys_runner [overrides]``: compose the config, validate it, build, train, log.

Kept tiny on purpose (torchtitan's ``train.py``): building lives in ``build.py``, the loop in
``runner.py``, tracking in ``tracking.py``.
"""

from __future__ import annotations

import logging
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from recsys_runner.build import build
from recsys_runner.config import flatten, register_configs, validate
from recsys_runner.errors import ConfigError
from recsys_runner.paths import CONFIG_PATH
from recsys_runner.runner import train

log = logging.getLogger("recsys_runner")
register_configs()


def run(cfg: DictConfig) -> float:
    """Run one job; returns the final eval AUC (the objective a sweeper maximizes)."""
    spec = validate(cfg)
    c = build(cfg, spec)
    status = "FAILED"
    try:
        overrides = _overrides()
        c.tracker.start(
            run_name=",".join(overrides) or "defaults",
            tags={"hydra.overrides": " ".join(overrides), "world_size": str(c.env.world_size)},
            params=flatten(cfg),
        )
        c.tracker.log_text(OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
        c.tracker.log_text(str(c.plan), "sharding_plan.txt")
        final = train(c)
        status = "FINISHED"
        return final["eval/auc"]
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        c.tracker.finish(status)
        c.close()


def _overrides() -> list[str]:
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


@hydra.main(config_path=CONFIG_PATH, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    try:
        return run(cfg)
    except ConfigError as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"Config error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
