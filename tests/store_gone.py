"""A tracking store that is gone as each sweep job's run ends: the tracker's final call (``set_terminated``) fails, so
the run's end goes to its replay file, and one job's replay file is lost (never written). Every other call reaches the
store: a launcher ending a run left RUNNING, the sweep's parent. Installed in the test process for an in-process sweep
(``monkeypatch.setattr``), or in a sweep's job processes by a ``sitecustomize`` hook (:data:`HOOK`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

HOOK = '''
"""Test hook (sitecustomize): in a sweep's submitit job processes only, tests/store_gone.py's store."""
import os

if os.environ.get("SUBMITIT_EXECUTOR"):
    from tests.store_gone import refuse_run_ends

    refuse_run_ends()
'''


def refuse_run_ends(patch: Callable[[Any, str, Any], None] = setattr, lost_job: str | None = "1") -> None:
    """From now on the store refuses the end of each run a tracker ends, and the replay file of the job numbered
    ``lost_job`` (its run's ``sweep.job_num``) is lost. ``patch``: how ``MlflowTracker.finish`` is replaced (``setattr``
    for a process of its own, ``monkeypatch.setattr`` in a test)."""
    from recsys_runner.tracking.outbox import unsent_file
    from recsys_runner.tracking.sweep_names import JOB_NUM_TAG
    from recsys_runner.tracking.tracker import MlflowTracker

    real_finish = MlflowTracker.finish

    def gone(*args: object, **kwargs: object) -> None:
        raise ConnectionError("tracking store gone")

    def lost(directory: Any, run_id: str, status: str) -> Any:
        return unsent_file(directory, run_id)

    def finish(self: MlflowTracker, status: str) -> None:
        client, outbox = self._client, self._outbox
        if self.run_id is None or client is None:
            real_finish(self, status)
            return
        loses = lost_job is not None and client.get_run(self.run_id).data.tags.get(JOB_NUM_TAG) == lost_job
        client.set_terminated = gone  # this client only, for this call only
        if loses:
            outbox.write = lost
        try:
            real_finish(self, status)
        finally:
            del client.set_terminated
            if loses:
                del outbox.write

    patch(MlflowTracker, "finish", finish)
