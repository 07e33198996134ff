"""Running untrusted, model-written Python: one process tree per run, isolated by the operating system.

Threat model: the program is hostile (it is sampled from a policy under optimization pressure). It may loop
forever, fork without end, allocate without end, print without end, spawn children that outlive it, signal
other processes, read the trainer's environment or files, write or delete files, or open network
connections (to the trainer's Ray cluster, say). Nothing it does may stop the run, change anything outside
its own working directory, or learn the trainer's secrets.

Full isolation (`mode == "namespaces"`: root on Linux with util-linux `unshare` and `setpriv`, as in the
containers we run in). Each run gets:
  - new network, mount and PID namespaces (`unshare --net --mount --pid --fork --kill-child --mount-proc`):
    no network at all (not even loopback: the trainer's Ray ports and sockets are out of reach), a private
    /proc in which no trainer process is visible, and all of the run's processes die with it;
  - a private tmpfs over /tmp, /var/tmp and /dev/shm (Ray's Unix sockets under /tmp are hidden); the working
    directory is /tmp/work on that tmpfs (size-capped), the only place the program can write;
  - an unprivileged user (uid/gid 65534, no supplementary groups, no capabilities, no_new_privs), so the
    project's and the system's files are read-only to it and other users' processes cannot be signalled;
  - a clean environment (PATH, HOME, LANG only) and `python -I -S` (no site-packages, no user paths);
  - rlimits: CPU seconds, address space, processes (per the sandbox uid), file size, open files;
  - a wall-clock timeout after which the whole process group is killed; stdout/stderr are read up to
    `max_output_bytes` each and the run is killed when a stream exceeds it;
  - death with the worker that started it: PR_SET_PDEATHSIG on `unshare`, whose --kill-child sets it on the
    namespace's init, re-armed by `setpriv --pdeathsig` (a uid change clears it); the init's death takes every
    process of the namespace along, so a killed actor or a SIGKILLed trainer leaves no program behind.
Not isolated: the program can read world-readable files of the host (system libraries, the project's source:
no secrets belong there), use CPU up to its limits, and see the kernel's global information (/proc/cpuinfo,
uname). A kernel exploit is out of scope.

Reduced isolation (`mode == "rlimits"`, anywhere else: not root, or no unshare/setpriv): rlimits, a new
session killed as a group, a private temporary directory as the working directory and a clean environment
only. No network, filesystem or user isolation: `Sandbox()` says so loudly (a warning) when it starts. The
program dies with its worker, but processes it forks do not (they outlive a killed worker until their rlimits).
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger(__name__)

SANDBOX_UID = 65534  # nobody
PR_SET_PDEATHSIG = 1  # prctl(2); looked up here, not between fork and exec
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
TMPFS_SIZE_MB = 64
CLEAN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp/work", "LANG": "C.UTF-8",
             "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
# inside the namespaces, as root, before dropping to the sandbox user: private tmpfs mounts, the working
# directory, then exec the program as uid 65534 with no privileges, killed when unshare dies
# (the staging directory is the shell's working directory: still reachable after /tmp is covered)
NAMESPACE_SCRIPT = """set -e
mount --make-rprivate /
for d in /tmp /var/tmp /dev/shm; do if [ -d "$d" ]; then mount -t tmpfs -o size={size}m,mode=0755 tmpfs "$d"; fi; done
mkdir /tmp/work
cp -r ./. /tmp/work/
chown -R {uid}:{uid} /tmp/work
chmod 0700 /tmp/work
cd /tmp/work
exec setpriv --reuid={uid} --regid={uid} --clear-groups --no-new-privs --inh-caps=-all --bounding-set=-all --pdeathsig KILL "$@"
"""


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0  # wall clock
    cpu_s: int = 5  # RLIMIT_CPU
    memory_mb: int = 512  # RLIMIT_AS
    max_processes: int = 32  # RLIMIT_NPROC of the sandbox user
    max_file_mb: int = 16  # RLIMIT_FSIZE
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 1 << 20  # per stream


@dataclass
class RunResult:
    stdout: str
    stderr: str
    returncode: Optional[int]
    timed_out: bool = False
    output_truncated: bool = False
    seconds: float = 0.0


def isolation_available() -> bool:
    """Namespaces + a user switch are possible here (root, util-linux unshare and setpriv, Linux)."""
    return sys.platform.startswith("linux") and os.geteuid() == 0 and bool(shutil.which("unshare")) \
        and bool(shutil.which("setpriv")) and bool(shutil.which("mount"))


class Sandbox:
    """Runs Python source under the isolation above; `mode` is "namespaces" or "rlimits" (reduced)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), python: str = sys.executable):
        self.limits, self.python = limits, os.path.realpath(python)
        self.mode = "namespaces" if isolation_available() and self._probe() else "rlimits"
        if self.mode != "namespaces":
            log.warning("SANDBOX: reduced isolation (rlimits, process group, private directory, clean environment "
                        "only): no network, filesystem or user isolation because this is not root on Linux with "
                        "util-linux unshare/setpriv (or they failed). Do not run untrusted code like this outside "
                        "a throwaway container.")

    def _probe(self) -> bool:
        try:
            return self._run_namespaced("print(1)", "", self.limits).stdout.strip() == "1"
        except OSError as e:
            log.warning("sandbox namespaces unavailable: %s", e)
            return False

    def run(self, source: str, stdin: str = "") -> RunResult:
        """Run `source` as a Python program with `stdin`; never raises for anything the program does."""
        if self.mode == "namespaces":
            return self._run_namespaced(source, stdin, self.limits)
        return self._run_reduced(source, stdin, self.limits)

    # ------------------------------------------------------------------------------------------ modes
    def _run_namespaced(self, source: str, stdin: str, limits: SandboxLimits) -> RunResult:
        with tempfile.TemporaryDirectory(prefix="nemo_grpo_sbx_") as staging:
            os.chmod(staging, 0o700)  # root-only: the program reaches only its copy in /tmp/work
            with open(os.path.join(staging, "main.py"), "w", encoding="utf-8") as f:
                f.write(source)
            script = NAMESPACE_SCRIPT.format(size=TMPFS_SIZE_MB, uid=SANDBOX_UID)
            cmd = ["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "--",
                   "/bin/sh", "-c", script, "sandbox", self.python, "-I", "-S", "main.py"]
            return _execute(cmd, stdin, limits, cwd=staging)

    def _run_reduced(self, source: str, stdin: str, limits: SandboxLimits) -> RunResult:
        with tempfile.TemporaryDirectory(prefix="nemo_grpo_sbx_") as work:
            with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
                f.write(source)
            env = dict(CLEAN_ENV, HOME=work)
            return _execute([self.python, "-I", "-S", "main.py"], stdin, limits, cwd=work, env=env)


def _die_with_parent(parent: int) -> None:
    """In the child before exec: SIGKILL when the worker that started it dies (or already has)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _set_limits(limits: SandboxLimits) -> None:
    """In the child before exec (inherited by the whole tree)."""
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb, limits.memory_mb * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_file_mb * mb, limits.max_file_mb * mb))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _execute(cmd: list[str], stdin: str, limits: SandboxLimits, cwd: str, env: Optional[dict] = None) -> RunResult:
    """Start `cmd` in a new session with the limits; feed stdin; read capped output; kill the group at the
    deadline or when a stream overflows."""
    start, parent = time.monotonic(), os.getpid()

    def in_child() -> None:
        _die_with_parent(parent)
        _set_limits(limits)

    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                            env=env if env is not None else dict(CLEAN_ENV), start_new_session=True,
                            preexec_fn=in_child)
    out, err, timed_out, truncated = _communicate(proc, stdin.encode(), limits, start)
    return RunResult(stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"),
                     returncode=None if timed_out else proc.returncode, timed_out=timed_out,
                     output_truncated=truncated, seconds=time.monotonic() - start)


def _communicate(proc: subprocess.Popen, stdin: bytes, limits: SandboxLimits,
                 start: float) -> tuple[bytes, bytes, bool, bool]:
    """Non-blocking reads of both pipes with a byte cap and the wall-clock deadline."""
    try:
        proc.stdin.write(stdin)
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for stream in bufs:
        os.set_blocking(stream.fileno(), False)
        sel.register(stream, selectors.EVENT_READ)
    timed_out = truncated = False
    while sel.get_map():
        left = limits.timeout_s - (time.monotonic() - start)
        if left <= 0:
            timed_out = True
            break
        for key, _ in sel.select(timeout=min(left, 0.1)):
            chunk = key.fileobj.read(65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            buf = bufs[key.fileobj]
            buf.extend(chunk[: max(0, limits.max_output_bytes - len(buf))])
            if len(buf) >= limits.max_output_bytes:
                truncated = True
        if truncated:
            break
    _kill_group(proc)
    for stream in bufs:
        stream.close()
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), timed_out, truncated


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group (in namespace mode also the namespace's init, so every process in it
    dies) and reap."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
