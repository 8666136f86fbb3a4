"""`draftgraph bench compare`: two server configurations, run alternately A B B A A B ...

Alternating in ABBA order cancels slow drift (thermal, background load). Each adjacent (A, B)
pair gives one log-ratio of the chosen metric; the reported ratio B/A is exp(mean log-ratio)
with a 95 % Student-t confidence interval.
"""

from __future__ import annotations

import math
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx

# two-sided 95 % Student-t quantiles by degrees of freedom
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t975(df: int) -> float:
    if df >= 30:
        return 2.042 if df < 60 else 1.96
    return _T975.get(df) or _T975[max(k for k in _T975 if k <= df)]


def abba_order(rounds: int) -> list[str]:
    """A B B A A B B A ... : 2·rounds runs."""
    return [("AB" if i % 2 == 0 else "BA")[j] for i in range(rounds) for j in range(2)]


def ratio_ci(pairs: list[tuple[float, float]]) -> dict:
    """Ratio B/A from paired (a, b) values: geometric mean of b/a with a 95 % CI."""
    logs = [math.log(b / a) for a, b in pairs if a > 0 and b > 0]
    if not logs:
        raise ValueError("no valid (A, B) pairs to compare")
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return {"ratio": math.exp(mean), "ci95": [None, None], "pairs": len(logs)}
    half = t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return {"ratio": math.exp(mean), "ci95": [math.exp(mean - half), math.exp(mean + half)],
            "pairs": len(logs)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`draftgraph serve MODEL <args>` on a free loopback port, in a subprocess."""

    def __init__(self, model: str, args: str, startup_timeout: float = 600.0) -> None:
        self.port = free_port()
        self.cmd = [sys.executable, "-m", "draftgraph.cli", "serve", model, "--host",
                    "127.0.0.1", "--port", str(self.port), "--log-level", "warning",
                    *shlex.split(args)]
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerProcess:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({shlex.join(self.cmd)}):\n"
                                   f"{self.proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"server did not become healthy in {self.startup_timeout:.0f} s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()

