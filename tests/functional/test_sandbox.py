"""The sandbox against hostile programs, one test per property of its threat model (nemo_grpo/envs/sandbox.py).

Each must be contained: the run stops, nothing outside its working directory changes, no process of the
sandbox user is left, and the next run works. Properties that need the namespaces are skipped (with the
reason) where the sandbox runs in reduced mode.
"""

import os
import socket
import subprocess
import threading
import time

import pytest

from nemo_grpo.envs.sandbox import SANDBOX_UID, Sandbox, SandboxLimits

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMITS = SandboxLimits(timeout_s=2.0, cpu_s=2, memory_mb=256, max_processes=16, max_output_bytes=64 * 1024)


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(LIMITS)


@pytest.fixture
def isolated(sandbox):
    if sandbox.mode != "namespaces":
        pytest.skip("needs the namespace sandbox (root on Linux with unshare/setpriv)")
    return sandbox


def sandbox_user_processes() -> int:
    out = subprocess.run(["ps", "-u", str(SANDBOX_UID), "-o", "pid="], capture_output=True, text=True).stdout
    return len(out.split())


def assert_contained_and_serving(sandbox):
    deadline = time.monotonic() + 5
    while sandbox_user_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_user_processes() == 0
    assert sandbox.run("print(6 * 7)").stdout == "42\n"


def test_runs_a_program_with_stdin(sandbox):
    r = sandbox.run("import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", "3 4 5")
    assert (r.stdout, r.returncode, r.timed_out) == ("12\n", 0, False)


def test_infinite_loop_is_stopped(sandbox):
    r = sandbox.run("while True:\n    pass")
    assert r.timed_out or r.returncode != 0
    assert r.seconds < LIMITS.timeout_s + 2
    assert_contained_and_serving(sandbox)


def test_fork_bomb_is_contained(isolated):
    r = isolated.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert r.timed_out or r.returncode != 0
    assert_contained_and_serving(isolated)


def test_memory_bomb_fails_inside(sandbox):
    r = sandbox.run("x = []\nwhile True:\n    x.append(bytearray(50 * 1024 * 1024))")
    assert r.returncode != 0 and "MemoryError" in r.stderr
    assert_contained_and_serving(sandbox)


def test_huge_output_is_capped(sandbox):
    r = sandbox.run("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1024 * 1024))")
    assert r.output_truncated and len(r.stdout) <= LIMITS.max_output_bytes
    assert_contained_and_serving(sandbox)


def test_writes_outside_the_working_directory_fail(isolated, tmp_path):
    targets = [os.path.join(ROOT, "sandbox_was_here"), "/etc/sandbox_was_here", "/root/sandbox_was_here",
               str(tmp_path / "sandbox_was_here")]
    program = "import os\nok = []\nfor p in %r:\n    try:\n        open(p, 'w').write('x')\n        ok.append(p)\n" \
              "    except OSError:\n        pass\nopen('mine.txt', 'w').write('fine')\nprint(ok, os.listdir('.'))"
    r = isolated.run(program % targets)
    assert "'mine.txt'" in r.stdout
    assert all(not os.path.exists(p) for p in targets), r.stdout  # /tmp of the run is its own tmpfs


def test_trainer_environment_is_not_readable(isolated, monkeypatch):
    monkeypatch.setenv("NEMO_GRPO_TEST_SECRET", "s3cr3t-token")
    program = ("import os, glob\nseen = [str(dict(os.environ))]\nfor p in glob.glob('/proc/*/environ'):\n"
               "    try:\n        seen.append(open(p).read())\n    except OSError:\n        pass\n"
               f"try:\n    seen.append(open('/proc/{os.getpid()}/environ').read())\nexcept OSError:\n    pass\n"
               "print('\\n'.join(seen))")
    r = isolated.run(program)
    assert r.returncode == 0 and "s3cr3t-token" not in r.stdout + r.stderr


def test_no_network_even_to_loopback(isolated):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(3)
    port = server.getsockname()[1]
    accepted = []
    thread = threading.Thread(target=lambda: _accept(server, accepted), daemon=True)
    thread.start()
    r = isolated.run(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                     "    print('connected')\nexcept OSError as e:\n    print('refused', type(e).__name__)")
    thread.join()
    server.close()
    assert "refused" in r.stdout and not accepted


def _accept(server, accepted):
    try:
        accepted.append(server.accept())
    except OSError:
        pass


def test_child_outliving_the_timeout_is_killed(isolated):
    r = isolated.run("import subprocess, time\nsubprocess.Popen(['sleep', '60'], start_new_session=True)\n"
                     "print('spawned', flush=True)\ntime.sleep(60)")
    assert r.timed_out and "spawned" in r.stdout
    assert_contained_and_serving(isolated)


def test_signalling_the_parent_or_the_trainer_fails(isolated):
    """The trainer's processes are not even visible (own PID namespace; the parent reads as pid 0); a kill of
    every process it may signal (-1) reaches only the run's own. The targets are this process and a sibling it
    started, not this process's parent: that is pid 1 where the test runner was orphaned, and pid 1 inside the
    namespace is the run's own init, which it may signal."""
    sibling = subprocess.Popen(["sleep", "60"])
    try:
        r = isolated.run(f"import os, signal\nprint('parent', os.getppid())\nfor pid in {(os.getpid(), sibling.pid)}:\n"
                         "    try:\n        os.kill(pid, signal.SIGKILL)\n        print('killed', pid)\n"
                         "    except OSError as e:\n        print('denied', pid, type(e).__name__)\n"
                         "os.kill(-1, signal.SIGKILL)")
        assert "parent 0" in r.stdout and "killed" not in r.stdout, r.stdout
        assert sibling.poll() is None  # the sibling outlived the run's kill(-1)
    finally:
        sibling.kill()
        sibling.wait()
    assert_contained_and_serving(isolated)  # and this process is still here to check


def test_project_files_cannot_be_deleted(isolated):
    sentinel = os.path.join(ROOT, "tests", "sandbox_sentinel.txt")
    with open(sentinel, "w") as f:
        f.write("keep")
    try:
        r = isolated.run(f"import os\ntry:\n    os.remove({sentinel!r})\n    print('deleted')\n"
                         f"except OSError as e:\n    print('denied', type(e).__name__)")
        assert "denied" in r.stdout and os.path.isfile(sentinel)
    finally:
        os.remove(sentinel)


def _cmdline(p) -> list[str]:
    try:
        return p.cmdline()
    except Exception:  # psutil.Error: gone, or a zombie
        return []


def test_a_killed_worker_takes_its_program_along(sandbox):
    """The worker that runs the sandbox dies (an actor killed, a trainer SIGKILLed): its program, and in namespace
    mode every process the program started, dies with it instead of sleeping on."""
    import signal
    import sys

    import psutil

    program = "import time\nprint('up', flush=True)\ntime.sleep(60)"
    if sandbox.mode == "namespaces":
        program = "import subprocess\nsubprocess.Popen(['sleep', '60'], start_new_session=True)\n" + program
    worker = subprocess.Popen([sys.executable, "-c", "from nemo_grpo.envs.sandbox import Sandbox, SandboxLimits\n"
                               f"Sandbox(SandboxLimits(timeout_s=60, cpu_s=60)).run({program!r})"], cwd=ROOT)
    want = [["main.py"], ["sleep", "60"]] if sandbox.mode == "namespaces" else [["main.py"]]
    deadline, tree = time.monotonic() + 30, []
    try:
        while not all(any(_cmdline(p)[-len(w):] == w for p in tree) for w in want):
            assert time.monotonic() < deadline and worker.poll() is None, [_cmdline(p) for p in tree]
            time.sleep(0.1)
            tree = psutil.Process(worker.pid).children(recursive=True)
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    _, left = psutil.wait_procs(tree, timeout=5)
    left = [(p, _cmdline(p)) for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p, _ in left:
        p.kill()
    assert not left, [cmd for _, cmd in left]
