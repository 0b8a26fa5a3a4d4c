"""``die_with_parent``: the kernel signals this process when the process that started it dies
(Linux ``prctl(PR_SET_PDEATHSIG)``). A DataLoader worker dies with its rank, a rank learns of
its launcher's death, even when the parent was killed with SIGKILL and could warn no one.

The signal comes when the parent *thread* that forked the process ends; torchrun and the
DataLoader start their children from the main thread, which lives as long as the process.
"""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(signum: int = signal.SIGKILL) -> bool:
    """Ask for ``signum`` when the parent dies; False where the kernel has no such call (not
    Linux). A parent that died before the call sends nothing: callers compare
    ``os.getppid()`` with the parent they expect."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
