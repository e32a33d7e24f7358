"""``hydra/launcher=submitit_slurm_detached``: submit a sweep to SLURM and return (submit-and-exit).

A Hydra plugin module (Hydra instantiates launchers only from the ``hydra_plugins`` namespace);
the recsys_runner side of launching lives in :mod:`recsys_runner.launch`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher

log = logging.getLogger(__name__)


class DetachedSlurmLauncher(SlurmLauncher):
    """``submitit_slurm`` that returns once the array is queued (submit-and-exit).

    Records the number of jobs and their SLURM ids on the sweep's MLflow parent run, so that
    ``python -m recsys_runner.compare collect`` knows how many children to wait for. Sweepers that
    need results to continue (Optuna) cannot use it.
    """

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
        from hydra.core.utils import JobReturn, JobStatus

        from recsys_runner.errors import ConfigError
        from recsys_runner.sweep import EXPECTED_JOBS_TAG
        from recsys_runner.tracking import PARENT_RUN_ENV, resolve_uri

        assert self.config is not None
        sweeper = str(self.config.hydra.sweeper.get("_target_", ""))
        if not sweeper.endswith("BasicSweeper"):
            raise ConfigError(f"hydra/launcher=submitit_slurm_detached returns before jobs finish, but {sweeper} needs their "
                              "results; use hydra/launcher=submitit_slurm")
        jobs = self._submit(job_overrides, initial_job_idx)
        parent = os.environ.get(PARENT_RUN_ENV)
        if parent:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=resolve_uri(self.config.tracking.get("uri")))
            client.set_tag(parent, EXPECTED_JOBS_TAG, str(len(jobs)))
            client.set_tag(parent, "sweep.slurm_job_ids", " ".join(j.job_id for j in jobs))
        log.info("submitted SLURM jobs %s; collect with: python -m recsys_runner.compare collect --parent %s --wait",
                 " ".join(j.job_id for j in jobs), parent)
        # "Completed" from the sweeper's point of view: submitting was the job; the value is the SLURM id.
        return [JobReturn(status=JobStatus.COMPLETED, _return_value=j.job_id) for j in jobs]

    def _submit(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[Any]:
        """Submit the array exactly as the plugin's ``SlurmLauncher.launch`` does, without waiting for results."""
        import submitit
        from hydra.core.singleton import Singleton
        from hydra.core.utils import filter_overrides
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
        from omegaconf import OmegaConf

        assert self.config is not None
        init_keys = {"submitit_folder", "max_num_timeout"}
        executor = submitit.AutoExecutor(cluster="slurm", folder=self.params["submitit_folder"],
                                         slurm_max_num_timeout=self.params.get("max_num_timeout", 0))
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in self.params.items() if k not in init_keys})
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        job_params = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
            job_params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        return list(executor.map_array(self, *zip(*job_params, strict=True)))
