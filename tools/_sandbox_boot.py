"""Runs inside fresh namespaces (as their root) to set up one sandboxed program and run it.

Started by ``python_sandbox.PythonTool`` as
``unshare --net --pid --mount --fork --kill-child --mount-proc -- python -I -S _sandbox_boot.py SPEC``
with the program's source on stdin. Standard library only (``-S``: no site-packages).

Steps: private tmpfs over every world-writable directory (so nothing written there outlives
the sandbox), a working directory inside it, then the program as a child with resource limits,
an unprivileged uid (limits on processes only bind non-root users) and a clean environment.
"""

import ctypes
import json
import os
import resource
import sys

MS_NOSUID, MS_NODEV = 2, 4


def mount_tmpfs(target: str, size_mb: int) -> None:
    if not os.path.isdir(target):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    options = f"size={size_mb}m,mode=1777".encode()
    if libc.mount(b"tmpfs", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs on {target}: {os.strerror(err)}")


def main() -> None:
    spec = json.loads(sys.argv[1])
    source = sys.stdin.buffer.read()
    for target in ("/tmp", "/var/tmp", "/dev/shm"):
        mount_tmpfs(target, spec["tmpfs_mb"])
    workdir = "/tmp/work"
    os.mkdir(workdir, 0o700)
    with open(os.path.join(workdir, "main.py"), "wb") as f:
        f.write(source)
    uid = spec["uid"]
    os.chown(workdir, uid, uid)
    os.chown(os.path.join(workdir, "main.py"), uid, uid)
    os.chdir(workdir)

    limits = {
        resource.RLIMIT_CPU: spec["cpu_time_s"],
        resource.RLIMIT_AS: spec["memory_mb"] * 1024 * 1024,
        resource.RLIMIT_NPROC: spec["max_processes"],
        resource.RLIMIT_FSIZE: spec["max_file_mb"] * 1024 * 1024,
        resource.RLIMIT_NOFILE: spec["max_open_files"],
        resource.RLIMIT_CORE: 0,
    }
    # Stay as the namespace's init (pid 1) and run the program as a child: init reaps
    # orphans, and its exit status reports a killing signal as 128 + signal (a signal that
    # killed init itself would be lost in unshare's own signal handling).
    child = os.fork()
    if child == 0:
        for kind, value in limits.items():
            # CPU: the hard limit one second later, so SIGXCPU (not SIGKILL) says why it ended
            resource.setrlimit(kind, (value, value + 1 if kind == resource.RLIMIT_CPU else value))
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        os.execve(spec["python"], [spec["python"], "-I", "-u", "main.py"], env)
    while True:
        pid, status = os.wait()
        if pid == child:
            break
    code = os.waitstatus_to_exitcode(status)
    sys.exit(128 - code if code < 0 else code)


if __name__ == "__main__":
    main()
