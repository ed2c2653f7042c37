"""Child processes the bench starts: logged to files, watched for crashes, always stopped.

Every child gets its own session (process group), so stopping it stops whatever it spawned
(uvicorn workers, node). `Procs.stop_all` runs at exit, on SIGTERM and on Ctrl-C.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

__all__ = ["Child", "Procs", "cpu_seconds", "free_port", "peak_rss_mb", "rss_mb", "wait_http"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log_path: Path
    started: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def log_tail(self, chars: int = 2000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-chars:].decode("utf-8", "replace")

    def describe_death(self) -> str:
        return f"{self.name} exited with status {self.exit_code()}; log tail:\n{self.log_tail(1500)}"


class Procs:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []
        log_dir.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop_all)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGHUP, self._on_signal)

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        self.stop_all()
        sys.exit(128 + signum)

    def start(self, name: str, argv: list[str], *, env: dict[str, str], cwd: str | Path | None = None) -> Child:
        log_path = self.log_dir / f"{name}.log"
        log = open(log_path, "ab")
        log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
        log.flush()
        popen = subprocess.Popen(
            argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        log.close()
        child = Child(name, popen, log_path)
        self.children.append(child)
        return child

    def stop(self, child: Child, timeout: float = 5.0) -> int | None:
        """SIGTERM the child's process group, then SIGKILL what is left."""
        if child.popen.poll() is None:
            _signal_group(child.popen.pid, signal.SIGTERM)
            try:
                child.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(child.popen.pid, signal.SIGKILL)  # leftovers of the group, if any
        try:
            child.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        if child in self.children:
            self.children.remove(child)
        return child.popen.returncode

    def stop_all(self) -> None:
        for child in list(reversed(self.children)):
            try:
                self.stop(child, timeout=3.0)
            except Exception:  # noqa: BLE001 - stopping must go on for the others
                pass


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)  # the child's own session: pgid == pid
    except (ProcessLookupError, PermissionError):
        pass


def wait_http(url: str, *, child: Child | None = None, timeout: float = 60.0, ok: Callable[[int], bool] | None = None,
              interval: float = 0.05) -> float:
    """Poll `url` until it answers (any status, or one `ok` accepts); returns the seconds waited."""
    started = time.monotonic()
    deadline = started + timeout
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while True:
            if child is not None and not child.alive():
                raise RuntimeError(child.describe_death())
            try:
                status = client.get(url).status_code
                if ok is None or ok(status):
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer within {timeout:.0f}s")
            time.sleep(interval)


def _status_kb(pid: int, field_name: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _tree(pid: int) -> list[int]:
    """pid and its descendants (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(parents.get(current, []))
    return found


def cpu_seconds(pid: int, *, tree: bool = False) -> float | None:
    """user + system CPU seconds used so far by the process (and its descendants with tree=True)."""
    total, found = 0.0, False
    ticks = os.sysconf("SC_CLK_TCK")
    for p in (_tree(pid) if tree else [pid]):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
            found = True
        except (OSError, ValueError, IndexError):
            continue
    return total if found else None


def peak_rss_mb(pid: int, *, tree: bool = False) -> float | None:
    """VmHWM (peak resident set) in MB; with tree=True, the sum over the process and its descendants."""
    pids = _tree(pid) if tree else [pid]
    values = [_status_kb(p, "VmHWM") for p in pids]
    values = [v for v in values if v is not None]
    return round(sum(values) / 1024, 1) if values else None


def rss_mb(pid: int, *, tree: bool = False) -> float | None:
    pids = _tree(pid) if tree else [pid]
    values = [_status_kb(p, "VmRSS") for p in pids]
    values = [v for v in values if v is not None]
    return round(sum(values) / 1024, 1) if values else None
