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
