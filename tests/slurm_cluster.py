"""A real single-node SLURM cluster on loopback, started and stopped by the tests (pytest fixture).

Debian's ``slurmctld slurmd slurm-client munge`` run as root without systemd: every daemon in the
foreground (``-D``/``-F``) as our own child, so its PID is the Popen's and it is stopped by that PID.
The daemons open their ports after start-up, so readiness is checked on the ports (and ``sinfo``),
never assumed. The configuration is the one measured for issue 6: ``proctrack/linuxproc``,
``task/none``, no accounting, ``AuthInfo=cred_expire=10`` (a requeued job otherwise waits ~120 s), and scheduling
passes every second (``bf_interval=1,sched_interval=1``): a requeued job becomes eligible ``cred_expire`` after its
requeue, which no event announces, so it waited for the next periodic pass (backfill's, every 30 s by default: ~28 s
from requeue to restart, measured, against ~11 s now).
Without slurmdbd ``sacct`` fails and submitit cannot see a cancelled or timed-out job, so a small
``sacct`` stand-in answering from ``squeue`` comes first on ``PATH``.

Where the machine cannot run it (not root, packages missing and not installable), the fixture skips
with the reason, and fails under ``CI=true`` (a skip is not a pass); ``make test`` installs the packages first where it
can (``.ci/install-slurm``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import SLURM_SKIP_MARK, free_port, skip_unless_ci

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scancel")

SACCT_STANDIN = """#!{python}
# sacct stand-in for a cluster without slurmdbd: answers submitit's
#   sacct -o JobID,State,NodeList --parsable2 -j ID [-j ID ...]
# from squeue, which keeps ended jobs (MinJobAge) with their final state.
import subprocess, sys
args = sys.argv[1:]
ids = [args[i + 1] for i, a in enumerate(args) if a == "-j" and i + 1 < len(args)]
print("JobID|State|NodeList")
for job in ids:
    out = subprocess.run(["squeue", "-h", "-r", "--states=all", "-j", job, "-o", "%i|%T|%N"],
                         capture_output=True, text=True)
    sys.stdout.write(out.stdout)
"""


def unavailable_reason() -> str | None:
    """Why this machine cannot run the test cluster, or None."""
    if os.geteuid() != 0:
        return "the test SLURM cluster runs its daemons as root (SlurmUser=root); not root here"
    missing = [b for b in BINARIES if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]
    if missing:
        return (f"SLURM/munge binaries missing: {missing}; install with "
                "`apt-get install -y slurmctld slurmd slurm-client munge` (`make test` does this as root: .ci/install-slurm)")
    return None




def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    """munged + slurmctld + slurmd for one node ``localhost`` with ``cpus`` CPUs, all under ``root``."""

    def __init__(self, root: Path, cpus: int = 2) -> None:
        self.root, self.cpus = root, cpus
        self.conf = root / "slurm.conf"
        self.bin = root / "bin"
        self.munge_socket = root / "munge" / "munge.sock"
        self.ctld_port, self.slurmd_port = free_port(), free_port()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def env(self) -> dict[str, str]:
        """What a client (sbatch, squeue, submitit, and the jobs they start) needs in its environment."""
        return {"SLURM_CONF": str(self.conf), "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"}

    def start(self, timeout_s: float = 60) -> None:
        self._write_files()
        try:
            self._spawn("munged", [_binary("munged"), "-F", "-f", "--socket", str(self.munge_socket),
                                   "--key-file", str(self.root / "munge" / "munge.key"),
                                   "--pid-file", str(self.root / "munge" / "munged.pid"),
                                   "--log-file", str(self.root / "munge" / "munged.log"),
                                   "--seed-file", str(self.root / "munge" / "munged.seed")])
            self._wait(lambda: self.munge_socket.exists(), "munged socket", timeout_s)
            env = {**os.environ, **self.env}
            self._spawn("slurmctld", [_binary("slurmctld"), "-D", "-i", "-f", str(self.conf)], env=env)
            self._wait(lambda: _listening(self.ctld_port), f"slurmctld on port {self.ctld_port}", timeout_s)
            self._spawn("slurmd", [_binary("slurmd"), "-D", "-N", "localhost", "-f", str(self.conf)], env=env)
            self._wait(lambda: _listening(self.slurmd_port), f"slurmd on port {self.slurmd_port}", timeout_s)
            self._wait(self._node_idle, "node localhost idle", timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Cancel every job, wait for them to end, then stop the daemons by PID (slurmd first)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            env = {**os.environ, **self.env}
            subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True, timeout=30)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                out = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True, timeout=30)
                if not out.stdout.strip():
                    break
                time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def logs(self) -> str:
        """The tail of every daemon log, for assertion messages."""
        parts = []
        for path in sorted(self.root.glob("**/*.log")):
            parts.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-3000:])
        return "\n".join(parts)

    def squeue(self, *args: str) -> str:
        return subprocess.run(["squeue", *args], env={**os.environ, **self.env}, capture_output=True, text=True, timeout=30).stdout

    # -- internals ---------------------------------------------------------------------------------
    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.root / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root)

    def _wait(self, ready: object, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}\n{self.logs()}")
            if ready():  # type: ignore[operator]
                return
            time.sleep(0.1)
        raise TimeoutError(f"{what} not ready after {timeout_s}s\n{self.logs()}")

    def _node_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env={**os.environ, **self.env}, capture_output=True, text=True,
                             timeout=30)
        return out.stdout.strip() == "idle"

    def _write_files(self) -> None:
        munge = self.root / "munge"
        munge.mkdir(mode=0o700, parents=True, exist_ok=True)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for d in ("state", "spool", "log"):
            (self.root / d).mkdir(exist_ok=True)
        self.bin.mkdir(exist_ok=True)
        sacct = self.bin / "sacct"
        sacct.write_text(SACCT_STANDIN.format(python=sys.executable))
        sacct.chmod(0o755)
        self.conf.write_text(f"""\
ClusterName=recsys-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmdPort={self.slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire=10
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd.pid
SlurmctldLogFile={self.root}/log/slurmctld.log
SlurmdLogFile={self.root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
MinJobAge=600
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
SlurmdParameters=config_overrides
NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")


@pytest.fixture(scope="module", name="slurm_cluster")
def slurm_cluster_fixture() -> Iterator[SlurmCluster]:
    """A running test cluster for the module; its client environment is exported while it runs."""
    reason = unavailable_reason()
    if reason:
        skip_unless_ci(f"{SLURM_SKIP_MARK} — this machine cannot run the test cluster: {reason}")
    # Short path: munge's and slurmd's unix sockets must fit in 108 bytes.
    root = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
    cluster = SlurmCluster(root, cpus=max(2, os.cpu_count() or 2))
    saved = {k: os.environ.get(k) for k in cluster.env}
    cluster.start()
    os.environ.update(cluster.env)
    try:
        yield cluster
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
