"""The container runtime's part of starting a container, for one pod of the harness (stdlib only).

Run as `nsenter --net=/run/netns/<pod> python -m tests.pods.podinit CONFIG.json`: the process is
already in the pod's network namespace. It makes new mount, UTS, IPC and PID namespaces, forks the
container's PID 1, which mounts the pod's volumes, /etc/hosts, /etc/resolv.conf, /dev/shm and a
private /tmp, sets the hostname and execs the container's command with exactly the given
environment. The parent waits and exits with the container's exit code as a runtime reports it
(128 + signal for a signal death). Killing the parent with SIGKILL kills PID 1 (PR_SET_PDEATHSIG),
and with it every process of the pod's PID namespace, like deleting a container.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import stat
import subprocess
import sys
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
PR_SET_PDEATHSIG = 1
NOFILE_HARD = 1048576
START_FAILED = 197  # the harness treats it as its own error, never as the container's exit


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True)


def _container(cfg: dict[str, Any]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # containerd's default open-files limit is 1048576 (KubeRay's `ulimit -n 65536` needs the headroom);
    # a sandbox without CAP_SYS_RESOURCE keeps its own limit (the `ulimit` then fails, non-fatally).
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, NOFILE_HARD))
    # Hold every bind source open first: a volume mounted at /tmp must not hide a later source there.
    sources = {i: os.open(m["src"], os.O_PATH) for i, m in enumerate(cfg["mounts"]) if m["type"] == "bind"}
    is_dir = {i: stat.S_ISDIR(os.fstat(fd).st_mode) for i, fd in sources.items()}
    _run("mount", "--make-rprivate", "/")
    _run("mount", "-t", "proc", "proc", "/proc")
    for i, m in enumerate(cfg["mounts"]):
        if m["type"] == "bind" and not is_dir[i]:
            if not os.path.exists(m["dst"]):
                open(m["dst"], "a").close()  # a file mount point (the runtime creates it)
        else:
            os.makedirs(m["dst"], exist_ok=True)
        if m["type"] == "tmpfs":
            _run("mount", "-t", "tmpfs", "-o", f"size={m['size']}", "tmpfs", m["dst"])
        else:
            _run("mount", "--no-canonicalize", "--bind", f"/proc/{os.getpid()}/fd/{sources[i]}", m["dst"])
            if m.get("ro"):
                _run("mount", "-o", "remount,bind,ro", m["dst"])
    if cfg.get("readonly_root"):
        _run("mount", "-o", "remount,bind,ro", "/")  # this namespace's root mount only
    for fd in sources.values():
        os.close(fd)
    name = cfg["hostname"].encode()
    if libc.sethostname(name, len(name)) != 0:
        raise OSError(ctypes.get_errno(), "sethostname")
    os.chdir(cfg["cwd"])
    argv = cfg["argv"]
    os.execvpe(argv[0], argv, cfg["env"])


def main() -> int:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWPID) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    pid = os.fork()
    if pid == 0:
        try:
            _container(cfg)
        except BaseException as exc:  # the runtime could not create the container (not a container exit)
            print(f"podinit: cannot start the container: {exc}", file=sys.stderr, flush=True)
            os._exit(START_FAILED)
    for sig in (signal.SIGTERM, signal.SIGINT):  # a stop of the pod reaches its PID 1, as kubelet does
        signal.signal(sig, lambda s, _f: os.kill(pid, s))
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


if __name__ == "__main__":
    sys.exit(main())
