"""Listing a local tree where a directory that cannot be read is an error, not "nothing there".

``glob.glob`` drops every OSError of the directories it scans (EIO, ESTALE, EACCES) and ``Path.glob``/``rglob`` drop
the directories they may not read: the files under them vanish from the answer. What ingest lists becomes a corpus,
and what a stage hashes says whether its done work stands, so here a directory that fails raises (its path named);
only a path that is not there (ENOENT, ENOTDIR) is an answer.

:func:`strict_glob` matches as ``glob.glob(pattern, recursive=True)`` does (``*``, ``?``, ``[…]`` within a component,
``**`` for any depth, names starting with ``.`` only when the component does; symlinked directories are not
descended by ``**``); :func:`walk_files` lists every file below a directory.
"""
from __future__ import annotations

import errno
import fnmatch
import os
from pathlib import Path
from typing import Iterator

ABSENT = frozenset({errno.ENOENT, errno.ENOTDIR})  # answers: the path is not there, or not a directory


def _raise(e: OSError) -> None:
    raise e


def walk_files(root: Path) -> Iterator[Path]:
    """Every file below ``root`` (not following symlinked directories), in no particular order; raises the OSError
    of a directory that cannot be read (``root`` absent: nothing)."""
    try:
        for d, _, files in os.walk(root, onerror=_raise):
            for f in files:
                yield Path(d) / f
    except OSError as e:
        if e.errno not in ABSENT or Path(e.filename or "") != Path(root):
            raise


def _there(p: Path) -> bool:
    """Whether ``p`` exists (a dangling symlink too, as glob says); ``os.path.lexists`` reads any error as "no"."""
    try:
        os.lstat(p)
    except OSError as e:
        if e.errno in ABSENT:
            return False
        raise
    return True


def _entries(d: Path, dirs_only: bool) -> list[os.DirEntry]:
    try:
        with os.scandir(d) as it:
            return [e for e in it if not dirs_only or e.is_dir()]
    except OSError as e:
        if e.errno in ABSENT:
            return []
        raise


def _expand(bases: list[Path], comp: str, last: bool) -> list[Path]:
    if comp == "**":  # the base itself and every directory below it (every file too, when it ends the pattern)
        out = []
        for b in bases:
            out.append(b)
            for d, dirs, files in os.walk(b, onerror=lambda e: _raise(e) if e.errno not in ABSENT else None):
                dirs[:] = sorted(x for x in dirs if not x.startswith("."))
                out += [Path(d) / x for x in dirs]
                out += [Path(d) / x for x in files if last and not x.startswith(".")]
        return out
    if not glob_magic(comp):
        return [b / comp for b in bases if _there(b / comp)]
    hidden = comp.startswith(".")
    return [b / e.name for b in bases for e in _entries(b, not last)
            if (hidden or not e.name.startswith(".")) and fnmatch.fnmatchcase(e.name, comp)]


def glob_magic(s: str) -> bool:
    return any(c in s for c in "*?[")


def strict_glob(pattern: str, root: Path | None = None) -> list[Path]:
    """The paths matching ``pattern`` (absolute, or relative to ``root``, taken as it is: its name is no pattern; by
    default the working directory), sorted; raises the OSError of a directory on the way that cannot be read."""
    parts = Path(pattern).parts
    if not parts:
        return []
    bases = [Path(parts[0])] if Path(pattern).is_absolute() else [Path(root) if root is not None else Path(".")]
    parts = parts[1:] if Path(pattern).is_absolute() else parts
    for i, comp in enumerate(parts):
        bases = _expand(bases, comp, i == len(parts) - 1)
    return sorted({Path(os.path.normpath(p)) for p in bases})
