"""Background processes tracked by pid file, never by name.

A pid file holds the pid and the process's start time (field 22 of /proc/<pid>/stat), so a pid that the
kernel has since given to another process is never signalled. Processes run in their own session: a
Ctrl-C in the terminal that started the cluster does not reach them; `stop` does.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from gpupool_devcluster.errors import DevClusterError

# processes started by this interpreter, by pid, so their exit status can be collected
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def _start_ticks(pid: int) -> int | None:
    """Process start time in clock ticks since boot, or None if there is no such (live) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its closing parenthesis
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie has exited; only its exit status is left
        return None
    return int(fields[19])


def rss_bytes(pid: int) -> int:
    """Resident set size of a live process (VmRSS), 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


@dataclass(frozen=True)
class TrackedProcess:
    """A process started by `start`, identified by pid and start time; its pid file is `pid_file`."""

    name: str
    pid: int
    start_ticks: int
    pid_file: Path
    log_file: Path

    def alive(self) -> bool:
        return _start_ticks(self.pid) == self.start_ticks

    def rss_bytes(self) -> int:
        return rss_bytes(self.pid) if self.alive() else 0

    def log_tail(self, lines: int = 5) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; reaps it if it is our child; removes the pid file."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while self.alive() and time.monotonic() < deadline:
                self._reap()
                time.sleep(0.05)
            if self.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                deadline = time.monotonic() + 5
                while self.alive() and time.monotonic() < deadline:
                    self._reap()
                    time.sleep(0.05)
            if self.alive():
                raise DevClusterError(f"{self.name} (pid {self.pid}) survived SIGKILL")
        self._reap(block=True)
        self.pid_file.unlink(missing_ok=True)

    def _reap(self, *, block: bool = False) -> None:
        """Collect the exit status if this interpreter started it (else init does). A multi-threaded
        process shows as a zombie before its last thread is gone, so the final reap waits for it."""
        child = _CHILDREN.get(self.pid)
        if child is None:
            return
        if block:
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                raise DevClusterError(f"{self.name} (pid {self.pid}) did not finish exiting") from None
        if child.poll() is not None:
            del _CHILDREN[self.pid]

    @classmethod
    def load(cls, pid_file: Path) -> TrackedProcess | None:
        """The process recorded in `pid_file`, or None when there is no such file."""
        try:
            record = json.loads(pid_file.read_text())
        except FileNotFoundError:
            return None
        except ValueError:
            raise DevClusterError(f"{pid_file} is not a gpupool pid file; remove it by hand") from None
        return cls(record["name"], record["pid"], record["start_ticks"], pid_file, Path(record["log_file"]))


def start(
    name: str, argv: list[str], pid_file: Path, log_file: Path, env: dict[str, str] | None = None
) -> TrackedProcess:
    """Start `argv` in the background with output to `log_file`, and record it in `pid_file`."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("ab") as log:
        log.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(argv)}\n".encode())
        log.flush()
        child = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            close_fds=True,
        )
    ticks = _start_ticks(child.pid)
    if ticks is None:  # it died at once: report its log
        child.wait()
        raise DevClusterError(f"{name} exited at start (code {child.returncode}); see {log_file}")
    process = TrackedProcess(name, child.pid, ticks, pid_file, log_file)
    pid_file.write_text(
        json.dumps({"name": name, "pid": child.pid, "start_ticks": ticks, "log_file": str(log_file), "argv": argv})
    )
    _CHILDREN[child.pid] = child  # keeps Popen from warning "still running" when collected
    return process
