"""Servers started from Python (a notebook, a test, a benchmark) and always stopped.

A server runs in a process of its own, on a free port of 127.0.0.1. ``BackgroundServer`` starts it,
waits until its health URL answers (or says why it never did: the end of its log), and stops it:
SIGTERM, then SIGKILL after a grace period. Nothing outlives its starter: every server is stopped at
interpreter exit, and labkit's own server is also told the starter's pid (``--parent-pid``), which
it watches, so a notebook kernel that is killed or restarted leaves no server behind.

    with start_server("target", max_num_seqs=8) as server:
        httpx.post(server.url + "/v1/completions", json={"prompt": "def add(", "max_tokens": 8})
"""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import httpx

_RUNNING: set["BackgroundServer"] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class BackgroundServer:
    """``command`` (a list; ``{port}`` in it becomes the port) run as a server process; ``start``
    waits for ``health`` to answer 200. Its output goes to a log file (``log()``)."""

    def __init__(self, command: Sequence[str], port: int | None = None, host: str = "127.0.0.1",
                 health: str = "/health", env: dict[str, str] | None = None) -> None:
        self.port = port or free_port(host)
        self.host, self.health = host, health
        self.command = [part.replace("{port}", str(self.port)) for part in command]
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None
        descriptor, name = tempfile.mkstemp(prefix="labkit-server-", suffix=".log")
        os.close(descriptor)
        self.log_path, self._final_log = Path(name), None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 120.0) -> "BackgroundServer":
        """Start the process and wait until it is healthy; a RuntimeError with its log if it dies
        or does not answer within ``timeout_s`` (it is stopped then)."""
        if self.process is not None:
            raise RuntimeError(f"the server on port {self.port} was started already")
        # a process group of its own: a notebook's interrupt, a SIGINT to the kernel's whole group, must not stop it;
        # the same session, though: where Linux shares the CPU between sessions (autogroup), a server in a session
        # of its own would take as much of it as its client and everything else the notebook runs together
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            stdin=subprocess.DEVNULL, process_group=0)
        _RUNNING.add(self)
        try:
            return self._wait_healthy(timeout_s)
        except BaseException:  # an interrupt while it starts: nothing half-started is left running
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> "BackgroundServer":
        deadline = time.monotonic() + timeout_s
        # one client for all polls (a new one costs ~50 ms of CPU); no proxy from the environment
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the server exited with code {self.process.returncode} before it answered:\n"
                                       f"{self.log()[-3000:]}")
                if self._healthy(client):
                    return self
                time.sleep(0.1)
        raise RuntimeError(f"the server did not answer {self.url}{self.health} within {timeout_s} s:\n"
                           f"{self.log()[-3000:]}")

    def _healthy(self, client: httpx.Client) -> bool:
        try:
            return client.get(self.url + self.health).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def engine_pid(self) -> int | None:
        """labkit's server's engine process (``--engine process``): the child that runs multiprocessing's
        ``spawn_main`` (the other, its resource tracker, does not); None without one. Linux (/proc)."""
        for pid in children(self.process.pid):
            with contextlib.suppress(OSError):
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
        return None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited after ``grace_s``; returns its exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        _RUNNING.discard(self)
        self._final_log = self.log()
        self.log_path.unlink(missing_ok=True)
        return self.process.returncode

    def log(self) -> str:
        """What the process printed (kept after ``stop``, which removes the file)."""
        if self._final_log is not None:
            return self._final_log
        return self.log_path.read_text(errors="replace")

    def __enter__(self) -> "BackgroundServer":
        return self if self.process is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def children(pid: int) -> list[int]:
    """The running processes that ``pid`` started, from /proc (Linux; elsewhere none are found)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError, ValueError):  # gone meanwhile
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(proc.name))
    return found


def serve_command(model: str = "target", **options: object) -> list[str]:
    """The command line of ``python -m labkit.serve`` on ``{port}``: each option ``max_num_seqs=8``
    becomes ``--max-num-seqs 8`` (True: a flag alone; None or False: left out)."""
    command = [sys.executable, "-m", "labkit.serve", "--model", model, "--port", "{port}",
               "--parent-pid", str(os.getpid())]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        command += [] if value in (None, False) else [flag] if value is True else [flag, str(value)]
    return command


def start_server(model: str = "target", timeout_s: float = 120.0, env: dict[str, str] | None = None,
                 **options: object) -> BackgroundServer:
    """labkit's server for ``model`` on a free port, started and healthy (see ``serve_command``)."""
    return BackgroundServer(serve_command(model, **options), env=env).start(timeout_s)


@atexit.register
def stop_all() -> None:
    """Stop every server this process started and has not stopped: at exit, and where a notebook cell that starts
    servers runs again (the ones its earlier run started would go on, unreferenced, until the kernel exits)."""
    for server in list(_RUNNING):
        server.stop(grace_s=5.0)
