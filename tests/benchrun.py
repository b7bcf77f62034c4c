"""Running a benchmark script end to end from a test, as a user would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_benchmark(*args: str, timeout: float = 900, check: bool = True) -> str:
    """``python <args>`` from the repository root; its stdout, or a failed assertion with
    the tail of its output if it exits non-zero (with ``check=False``: exit 1, a missed
    speed target, is accepted; anything else fails)."""
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode in ((0,) if check else (0, 1)), r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout
