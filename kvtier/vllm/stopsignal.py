"""Learning early that vLLM's engine core is being stopped.

vLLM 0.32's engine core (``run_engine_core`` in ``vllm/v1/engine/core.py``) installs
SIGTERM and SIGINT handlers before it builds the scheduler (and so this connector's
scheduler side); they only mark the engine as stopping. With ``--shutdown-timeout N > 0``
the engine then drains for as long as the scheduler has work, and calls the connector's
``shutdown()`` last, after the model executor's (up to 5 + 4 s with live workers). With
the default ``N = 0`` the API server SIGKILLs the engine core milliseconds after its
SIGTERM: no code of ours runs at all (``max_dirty_seconds`` is what bounds that loss).

A stop signal is the first and, on some paths, the only notice that a flush must start
now (see README "What survives a stop" for each path). ``chain_stop_signals`` adds a
callback in front of the handlers installed at that moment, and only when there is one
to chain to (a Python callable: vLLM's). It never replaces a handler: vLLM's graceful
stop runs exactly as before.

The callback runs inside a signal handler on the main thread, which may be interrupted
anywhere: it must take no lock, do no I/O and log nothing (set a flag).

Threads: ``chain_stop_signals`` may be called only on the main thread (Python's rule for
``signal.signal``); anywhere else it installs nothing and returns False.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def chain_stop_signals(callback: Callable[[], None]) -> bool:
    """Call ``callback`` first whenever a stop signal arrives, then the handler that was
    installed before. Returns whether anything was installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    installed = False
    for sig in STOP_SIGNALS:
        prev = signal.getsignal(sig)
        if not callable(prev):
            continue  # SIG_DFL / SIG_IGN / None: nothing of the host's to chain to

        def handler(signum: int, frame: FrameType | None,
                    prev: Callable[[int, FrameType | None], object] = prev) -> None:
            callback()
            prev(signum, frame)

        signal.signal(sig, handler)
        installed = True
    return installed
