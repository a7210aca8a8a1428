"""A Ray head of our own for tests: on 127.0.0.1, stopped by process group.

The head listens on loopback only (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes Ray keep
127.0.0.1 instead of swapping in the machine's network address), with 2 CPUs and a 100 MB
object store. Teardown stops exactly the processes it started (the head's process group),
also when the test fails, rather than ``ray stop``, which would stop every Ray instance of
this user on the machine.
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
from contextlib import contextmanager
from pathlib import Path

import pytest

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def ray_head() -> Iterator[str]:
    """A Ray head on 127.0.0.1:<free port>; yields its address."""
    port = _free_port()
    # A short temp dir: Ray puts unix sockets under it (107-character path limit).
    temp = Path(tempfile.mkdtemp(prefix="qkray-", dir="/tmp"))
    log = open(temp / "head.log", "wb")  # noqa: SIM115 - closed in teardown
    env = dict(os.environ, **LOOPBACK_ENV)
    cmd = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; "
           "sys.exit(main())", "start", "--head", "--node-ip-address=127.0.0.1",
           f"--port={port}", "--num-cpus=2", "--object-store-memory=100000000",
           "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}",
           "--block"]
    head = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while b"Ray runtime started" not in (temp / "head.log").read_bytes():
            if head.poll() is not None or time.monotonic() > deadline:
                pytest.fail("ray head did not start:\n"
                            + (temp / "head.log").read_text(errors="replace")[-3000:])
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        _stop_group(head)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the head's process group, then SIGKILL whatever is left of it."""
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            proc.poll()
            time.sleep(0.1)
    proc.poll()
