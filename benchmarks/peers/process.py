"""A peer server's process (started, waited for, stopped with all it spawned) and what the
machine was doing around a measured window."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx


class PeerProcess:
    """A peer server in its own process group (stopped with everything it spawned)."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        env: dict[str, str],
        base_url: str,
        log: Path,
        cwd: Path | None = None,
    ) -> None:
        self.name, self.cmd, self.env, self.base_url, self.log = name, cmd, env, base_url, log
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_path: str = "/v1/models", timeout_s: float = 300.0) -> float:
        """Starts the server and waits for ``ready_path`` to answer 200; returns seconds."""
        t0 = time.monotonic()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as fh:
            fh.write(f"\n$ {shlex.join(self.cmd)}\n".encode())
            fh.flush()
            self.proc = subprocess.Popen(
                self.cmd,
                env={**os.environ, **self.env},
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, for stop()
                cwd=self.cwd,
            )
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} before answering; "
                    f"see {self.log} (last lines: {tail(self.log)!r})"
                )
            try:
                if httpx.get(self.base_url + ready_path, timeout=2.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{self.name} not ready after {timeout_s:g} s; see {self.log}")

    def stop(self, grace_s: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        try:
            os.killpg(pgid, signal.SIGTERM)
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass
        # Children that outlived the leader (engine processes) go with the group.
        with suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def tail(path: Path, chars: int = 400) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def top_snapshot(lines: int = 12) -> list[str]:
    """The busiest processes right now (``top -bn1``), kept with each window as evidence."""
    try:
        out = subprocess.run(
            ["top", "-bn1", "-w", "160"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = out.splitlines()
    head = next((i for i, r in enumerate(rows) if r.lstrip().startswith("PID")), 0)
    return rows[:3] + rows[head : head + lines]


def load_note() -> dict[str, Any]:
    return {"loadavg": list(os.getloadavg()), "at": time.strftime("%Y-%m-%d %H:%M:%S")}


@contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set inside the block, as it was after it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
