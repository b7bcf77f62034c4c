"""Running a benchmark script end to end from a test, as a user would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_benchmark(*args: str, timeout: float = 900) -> str:
    """``python <args>`` from the repository root; its stdout, or a failed assertion with
    the tail of its output if it exits non-zero."""
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout
