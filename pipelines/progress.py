"""Progress bars for long work (tqdm on stderr; sparse updates when not on a terminal)."""
from __future__ import annotations

import os
import sys

from tqdm.auto import tqdm


def progress(**kw) -> tqdm:
    """A tqdm bar; ``LLMP_PROGRESS=0`` turns bars off, logs (non-TTY) get an update every 10 s."""
    off = os.environ.get("LLMP_PROGRESS", "1") == "0" or kw.pop("disable", False)
    tty = sys.stderr.isatty()
    kw.setdefault("mininterval", 0.5 if tty else 10.0)
    kw.setdefault("dynamic_ncols", True)
    return tqdm(disable=off, file=sys.stderr, **kw)
