"""Process-wide control of standard error, for orbax's reads and writes (cleanrl_utils/checkpoints.py): what this
module does affects the whole process, every thread and the C code in it, not just the caller.

`stderr_held` redirects file descriptor 2 into a pipe for the length of one read or write, and prints what was held
only if it succeeded. After one failed, `drop_abandoned_io_reports` replaces `sys.stderr` (other threads' writes are
dropped from then on), points descriptor 2 at /dev/null for the rest of the process, filters asyncio's logger and
warnings, and wraps `sys.unraisablehook`: the failed operation's one line has been said, and the tracebacks that
orbax's and tensorstore's abandoned tasks print later, perhaps only at exit, would bury it.
"""

import logging
import os
import sys
import threading
import warnings
from contextlib import contextmanager


@contextmanager
def stderr_held():
    """A failed write or read fails in each of orbax's threads, and each prints its own traceback (absl logs, and
    tensorstore callbacks that reach a closed event loop), at the C level too: what is printed to stderr during a
    write or read is held, printed after one that succeeded and dropped after one that failed (its error is the run's
    one line), with what the abandoned tasks report later (`drop_abandoned_io_reports`). Held in memory, through a
    pipe: on a full disk no file can hold it."""
    sys.stderr.flush()
    stderr = os.dup(2)
    read_end, write_end = os.pipe()
    held = bytearray()

    def drain():
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                held.extend(chunk)

    drainer = threading.Thread(target=drain, name="stderr-held", daemon=True)
    drainer.start()
    os.dup2(write_end, 2)
    os.close(write_end)
    succeeded = False
    try:
        yield
        succeeded = True
    finally:
        sys.stderr.flush()
        if succeeded:
            os.dup2(stderr, 2)  # the pipe's last write end closes: the drainer reads to its end
        else:  # the failed read's or write's other threads may go on printing: dropped from now on
            drop_abandoned_io_reports(os.dup(stderr))
        os.close(stderr)
        drainer.join(timeout=10)
        if succeeded:
            sys.stderr.write(bytes(held).decode(errors="replace"))
            sys.stderr.flush()


class MainThreadOnly:
    """sys.stderr, but what other threads write is dropped."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        if threading.current_thread() is threading.main_thread():
            return self.stream.write(text)
        return len(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def drop_abandoned_io_reports(stderr: int | None = None):
    """After a read or write failed (its one line says so, from the main thread): what orbax and tensorstore left
    behind reports itself later, perhaps only as the process exits: tensorstore's callbacks into a closed event loop
    print tracebacks from their own threads, and collected coroutines and futures print "Exception ignored in:
    <coroutine ...>" or asyncio's "exception was never retrieved". Those reports are dropped: from here on, stderr
    takes the main thread's writes only (file descriptor 2 itself, written by C code and at exit, goes nowhere), and the
    unraisable reports of their coroutines are not shown."""
    logging.getLogger("asyncio").addFilter(lambda record: "never retrieved" not in record.getMessage())
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
    sys.stderr.flush()
    if isinstance(sys.stderr, MainThreadOnly):  # already: sys.stderr writes to the real stderr
        if stderr is not None:
            os.close(stderr)
    else:  # sys.stderr to the real stderr (`stderr`, or a copy of descriptor 2)
        stderr = os.dup(2) if stderr is None else stderr
        sys.stderr = MainThreadOnly(open(stderr, "w", buffering=1, errors="backslashreplace"))
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)  # descriptor 2, and what C code and the exit write there, to /dev/null
    os.close(devnull)
    previous = sys.unraisablehook

    def hook(unraisable):
        code = getattr(unraisable.object, "cr_code", None) or getattr(unraisable.object, "gi_code", None)
        if code is not None and any(name in code.co_filename for name in ("orbax", "tensorstore", "asyncio")):
            return
        previous(unraisable)

    sys.unraisablehook = hook
