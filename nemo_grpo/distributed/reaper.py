"""A local Ray cluster dies with the driver that started it, even when the driver is SIGKILLed.

Ray ties the head's processes to the driver that started them (PR_SET_PDEATHSIG on gcs_server, raylet, the log
monitor, the dashboard and the autoscaler monitor), and the workers exit when their raylet dies. The raylet's two
agents (ray::DashboardAgent, ray::RuntimeEnvAgent) do not, with Ray 2.60: they notice the raylet's death, report
it to the GCS, which died in the same instant, and block in that call for its 60 s timeout
(ray/_private/process_watcher.py::report_raylet_error_logs, publish_error(..., 60)).

This process is Ray's own reaper (ray/_private/ray_process_reaper.py: EOF on stdin means the parent died; SIGTERM,
a second's grace, SIGKILL) aimed at the cluster's processes instead of a process group (ours is the user's shell
job): a process belongs to the cluster when it holds a file in the cluster's session directory, where every Ray
process writes its logs, or takes that directory as an option's value (`--session-dir=...`). Started by
`init_ray` only for a cluster it starts, never for one it joins.

    python -m nemo_grpo.distributed.reaper SESSION_DIR DRIVER_PID   # stdin: a pipe only the driver writes to
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

GRACE_S = 1.0  # between SIGTERM and SIGKILL, as Ray's reaper
KILL_WAIT_S = 10.0  # after SIGKILL: the longest the killed processes get to be gone
_WRITE_ENDS: list[int] = []  # the driver's ends of the pipes, as bare fds: only the kernel closes them, at exit


def start_reaper(session_dir: str) -> subprocess.Popen:
    """Start the reaper of the cluster whose session directory is `session_dir` (in the driver, after ray.init).

    Its own session keeps the terminal's SIGINT / SIGHUP (meant for the driver) away from it. The write end is a
    bare fd (not inherited by children), so EOF means this process has exited, not that its objects were freed."""
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "nemo_grpo.distributed.reaper", os.path.realpath(session_dir),
                                 str(os.getpid())], stdin=read_end, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    finally:
        os.close(read_end)
    _WRITE_ENDS.append(write_end)
    return proc


def session_processes(session_dir: str) -> list[int]:
    """Pids of the processes (other than this one) holding a file under `session_dir`, or taking it as an option's
    value on their command line (`--session-dir=DIR`: a process the driver has just started, e.g. Ray's log
    monitor on a loaded machine, may not have opened its files yet)."""
    prefix, pids = session_dir.rstrip("/") + "/", []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                named = b"=" + prefix.rstrip("/").encode() + b"\0" in f.read()
            fds = [] if named else os.listdir(f"/proc/{name}/fd")
            if named or any(os.readlink(f"/proc/{name}/fd/{fd}").startswith(prefix) for fd in fds):
                pids.append(int(name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


def reap(session_dir: str, spare: int, grace_s: float = GRACE_S, kill_wait_s: float = KILL_WAIT_S) -> None:
    """SIGTERM the cluster's processes but `spare` (the driver); after `grace_s`, SIGKILL those still there, and
    any that appeared meanwhile, until none holds a file in the session directory (a killed process holds its
    files until it has exited, which a loaded machine can take a while to finish) or `kill_wait_s` has passed."""
    _signal(session_dir, spare, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _others(session_dir, spare) and time.monotonic() < deadline:
        time.sleep(0.1)
    deadline = time.monotonic() + kill_wait_s
    while _signal(session_dir, spare, signal.SIGKILL) and time.monotonic() < deadline:
        time.sleep(0.1)


def _others(session_dir: str, spare: int) -> list[int]:
    """The cluster's processes but `spare`."""
    return [pid for pid in session_processes(session_dir) if pid != spare]


def _signal(session_dir: str, spare: int, sig: int) -> list[int]:
    """Send `sig` to the cluster's processes but `spare`; their pids."""
    pids = _others(session_dir, spare)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    return pids


def main(argv: list[str]) -> int:
    """argv: SESSION_DIR DRIVER_PID."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # only the driver's end decides
    while sys.stdin.buffer.read(4096):
        pass  # b"" at EOF: the driver is gone
    reap(argv[0], spare=int(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
