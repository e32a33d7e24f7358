"""A rank of a multi-rank launch ends its process without the interpreter's native teardown once its command's work is
done (lifecycle.end_rank_process): the Python-level exit still happens (non-daemon threads joined, atexit handlers run,
streams flushed), exit status 0; a single process returns and exits normally."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import atexit, logging, sys, threading, time
from pathlib import Path
from recsys_runner.lifecycle import end_rank_process
out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
logging.basicConfig(filename=out / "log.txt", level=logging.INFO, force=True)
logging.getLogger("x").info("logged before the end")
threading.Thread(target=lambda: (time.sleep(0.3), (out / "thread").write_text("joined"))).start()
print("work done", flush=False)
end_rank_process()
(out / "after").write_text("returned")
"""


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_a_rank_of_a_multi_rank_launch_ends_after_the_python_exit_work(world_size: str, tmp_path: Path) -> None:
    env = {**os.environ, "WORLD_SIZE": world_size}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "work done" in result.stdout  # flushed before os._exit
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "joined"
    assert "logged before the end" in (tmp_path / "log.txt").read_text()
    assert (tmp_path / "after").exists() == (world_size == "1"), "only a single process returns from end_rank_process"


FROZEN_EXIT = """
import atexit, gc, logging, sys
from pathlib import Path
from recsys_runner.collection import skip_the_exit_collection
out = Path(sys.argv[1])
freezes, freeze = [], gc.freeze
gc.freeze = lambda: (freezes.append(1), freeze())  # what the function registers: counted
# registered first, so run last: after the freeze
atexit.register(lambda: (out / "frozen").write_text(f"{len(freezes)} {gc.get_freeze_count() > 0}"))
logging.basicConfig(filename=out / "log.txt", level=logging.INFO, force=True)
skip_the_exit_collection()
skip_the_exit_collection()
atexit.register(lambda: (out / "atexit").write_text("ran"))
logging.getLogger("x").info("logged before the end")
print("work done", end="")
"""


def test_the_exit_skips_collecting_the_objects_of_the_command_and_still_does_the_python_exit_work(tmp_path: Path) -> None:
    """collection.skip_the_exit_collection: once registered however often called, it freezes the objects as the last
    ``atexit`` handler (the interpreter's teardown then does not collect them: seconds with torch loaded); the other
    handlers, logging's flush and the standard streams' still run, exit status 0."""
    result = subprocess.run([sys.executable, "-c", FROZEN_EXIT, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "work done" and (tmp_path / "atexit").read_text() == "ran"
    assert "logged before the end" in (tmp_path / "log.txt").read_text()
    assert (tmp_path / "frozen").read_text() == "1 True", "frozen once, by the last handler"
