"""What an ``OSError`` on a path says, one rule for every stage.

* an **answer** about the path (:data:`ANSWERS`): it is not there, not a directory, a directory, a loop, a name too
  long, something in the way. What the path holds is known; no retry changes it.
* a **refusal** to this user (:data:`REFUSALS`: EACCES, EPERM): what the path holds is unknown to this user, and no
  retry reads it: the user gives access (exit 2).
* anything else is **storage failing** (EIO, ESTALE, ENOSPC, EROFS, ETIMEDOUT, EINVAL from a file system …): what the
  path holds is unknown and a retry may read it (exit 75).

An ``OSError`` without an errno is the caller's to judge.
"""
from __future__ import annotations

import errno

ANSWERS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ENAMETOOLONG, errno.EEXIST,
                     errno.ENOTEMPTY})
REFUSALS = frozenset({errno.EACCES, errno.EPERM})


def unanswered(e: BaseException) -> bool:
    """Whether ``e`` leaves what the path holds unknown: an errno that is not an answer (storage failing or a
    refusal)."""
    return isinstance(e, OSError) and e.errno is not None and e.errno not in ANSWERS


def refused(e: BaseException) -> bool:
    """Whether ``e`` is a refusal to this user (the user's to fix: give access)."""
    return isinstance(e, OSError) and e.errno in REFUSALS


def storage_failing(e: BaseException) -> bool:
    """Whether ``e`` is storage failing: unknown, and a retry may read it."""
    return unanswered(e) and not refused(e)
