"""An inference server the library starts, and always stops: ``ServerProcess``.

The server never outlives the process that started it, however that process ends:

* the server runs under a **guard**: a small Python process (this file run as a script, its ``main``; it imports
  nothing but the standard library, so it starts at once) that starts the server in a session (process group) of
  its own and then waits on a pipe whose write end only the starting process holds. When that process closes it
  (``stop()``), or dies in any way (an exception, Ctrl-C, ``SIGKILL``, a crash: the kernel closes its descriptors),
  the guard reads end-of-file, sends ``SIGTERM`` to the server's whole process group, waits ``grace`` seconds, sends
  ``SIGKILL`` to what is left and exits. The guard also exits (and cleans up) when the server itself exits.
* ``stop()`` is called by the engine's ``close`` (the data module's teardown) and by an ``atexit`` hook, and is
  idempotent; it waits until the guard, and so the server's group, are gone.

Ctrl-C in a terminal reaches the whole foreground group, guard included: the guard ignores ``SIGINT`` and stops
the server when the trainer's end closes the pipe, so the server is never left half-stopped while the trainer
still shuts down.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ServerProcess", "free_port", "post_json"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def post_json(url: str, body: dict | None = None, timeout: float = 600.0) -> dict:
    """POST ``body`` as JSON to ``url`` and return the decoded answer (``{}`` for an empty one); an HTTP error
    raises ``RuntimeError`` with the server's message."""
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            raw = answer.read()
    except urllib.error.HTTPError as error:
        raise RuntimeError(f"{url}: HTTP {error.code}: {error.read().decode(errors='replace')[:2000]}") from None
    return json.loads(raw) if raw.strip() else {}


def _alive(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


class ServerProcess:
    """A server command run under the guard (see the module docstring).

    Args:
        command: the server's command line.
        health_url: polled until it answers 200 (``wait_ready``).
        log_path: the server's stdout and stderr (its last lines are quoted when it fails to start).
        env: extra environment variables for the server.
        grace: seconds between ``SIGTERM`` and ``SIGKILL`` when stopping.
    """

    def __init__(self, command: Sequence[str], health_url: str, log_path: str | Path,
                 env: dict[str, str] | None = None, grace: float = 15.0) -> None:
        self.command, self.health_url, self.log_path = list(command), health_url, Path(log_path)
        read_end, self._write_end = os.pipe()
        os.set_inheritable(self._write_end, False)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.guard = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), str(read_end), str(grace), "--",
                 *self.command], pass_fds=(read_end,), stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})})
        os.close(read_end)
        self._stopped = False
        atexit.register(self.stop)

    @property
    def pid(self) -> int:
        """The guard's process id (the server's group is stopped with it)."""
        return self.guard.pid

    def server_pid(self, timeout: float = 30.0) -> int | None:
        """The server's own process id, as the guard wrote it on its first log line (``None`` before that)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log_path.read_text(errors="replace").splitlines():
                if line.startswith("[rl_lightning guard] server pid "):
                    return int(line.rsplit(" ", 1)[1])
            time.sleep(0.1)
        return None

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout: float) -> None:
        """Block until ``health_url`` answers; stop the server and raise if it exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.guard.poll() is not None:
                self.stop()
                raise RuntimeError(f"the inference server exited (code {self.guard.returncode}) before it was "
                                   f"ready; its log {self.log_path} ends:\n{self.log_tail()}")
            if _alive(self.health_url):
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the inference server was not ready within {timeout:.0f} s ({self.health_url}); "
                           f"stopped it. Its log {self.log_path} ends:\n{self.log_tail()}")

    def stop(self) -> None:
        """Stop the server's process group and wait for the guard (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        try:
            os.close(self._write_end)
        except OSError:
            pass
        try:
            self.guard.wait(timeout=120)
        except subprocess.TimeoutExpired:  # the guard itself hangs: take it down with what it guards
            self.guard.kill()
            self.guard.wait()
        atexit.unregister(self.stop)


def _stop_group(pgid: int, grace: float) -> None:
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """The guard: ``python serving.py READ_FD GRACE -- COMMAND...``."""
    import selectors

    argv = list(sys.argv[1:] if argv is None else argv)
    fd, grace, command = int(argv[0]), float(argv[1]), argv[argv.index("--") + 1:]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer's end decides (see the module docstring)
    server = subprocess.Popen(command, start_new_session=True)
    print(f"[rl_lightning guard] server pid {server.pid}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (_stop_group(server.pid, grace), sys.exit(143)))
    selector = selectors.DefaultSelector()
    selector.register(fd, selectors.EVENT_READ)
    while server.poll() is None:
        if selector.select(timeout=0.5) and not os.read(fd, 1):  # end-of-file: the trainer is gone or done
            break
    _stop_group(server.pid, grace)
    server.wait()
    print(f"[rl_lightning guard] server stopped (code {server.returncode})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
