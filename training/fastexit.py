"""End a worker process without Python's interpreter teardown.

With torch and `torch._dynamo` imported, tearing the interpreter down (freeing every module) takes
about 1 s of CPU here, paid by every trainer, host and agent at the end of every run and restart.
`exit_now` does what matters of that teardown, in the order `multiprocessing` does for its children:
join the non-daemon threads (`threading._shutdown`: an upload still in flight finishes), run the
`atexit` handlers, flush stdout/stderr and the logging handlers, then `os._exit`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from typing import NoReturn

__all__ = ["exit_now"]


def exit_now(code: int) -> NoReturn:
    """Exit with `code` after threads, `atexit` handlers and flushes (see the module docstring)."""
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    with contextlib.suppress(BaseException):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(code)
