"""A local Ray cluster dies with the driver that started it, even when the driver is SIGKILLed.

Ray ties the head's processes to the driver that started them (PR_SET_PDEATHSIG on gcs_server, raylet, the log
monitor, the dashboard and the autoscaler monitor), and the workers exit when their raylet dies. The raylet's two
agents (ray::DashboardAgent, ray::RuntimeEnvAgent) do not, with Ray 2.60: they notice the raylet's death, report
it to the GCS, which died in the same instant, and block in that call for its 60 s timeout
(ray/_private/process_watcher.py::report_raylet_error_logs, publish_error(..., 60)).

This process is Ray's own reaper (ray/_private/ray_process_reaper.py: EOF on stdin means the parent died; SIGTERM,
a second's grace, SIGKILL) aimed at the cluster's processes instead of a process group (ours is the user's shell
job): a process belongs to the cluster when it holds a file in the cluster's session directory, where every Ray
process writes its logs. Started by `init_ray` only for a cluster it starts, never for one it joins.

    python -m nemo_grpo.distributed.reaper SESSION_DIR DRIVER_PID   # stdin: a pipe only the driver writes to
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

GRACE_S = 1.0  # between SIGTERM and SIGKILL, as Ray's reaper
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
    """Pids of the processes (other than this one) holding a file under `session_dir`."""
    prefix, pids = session_dir.rstrip("/") + "/", []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
            if any(os.readlink(f"/proc/{name}/fd/{fd}").startswith(prefix) for fd in fds):
                pids.append(int(name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


def reap(session_dir: str, spare: int, grace_s: float = GRACE_S) -> None:
    """SIGTERM the cluster's processes but `spare` (the driver); SIGKILL those still there after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        pids = [pid for pid in session_processes(session_dir) if pid != spare]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline and set(pids) & set(session_processes(session_dir)):
            time.sleep(0.1)


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
