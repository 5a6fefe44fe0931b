"""Listing a local tree where a directory that cannot be read is an error, not "nothing there".

``glob.glob`` drops every OSError of the directories it scans (EIO, ESTALE, EACCES) and ``Path.glob``/``rglob`` drop
the directories they may not read: the files under them vanish from the answer. What ingest lists becomes a corpus,
and what a stage hashes says whether its done work stands, so here a directory that fails raises (its path named);
only a path that is not there (ENOENT, ENOTDIR: one removed while it was listed too) is an answer, and so is an
entry whose stat says it cannot be entered (a symlink loop, a dangling link: not a directory); an entry the pattern
would enter whose stat fails (EIO, EACCES on a symlink's target) raises.

:func:`strict_glob` matches as ``glob.glob(pattern, recursive=True)`` does and returns its paths sorted as strings:
``*``, ``?``, ``[…]`` within a component, ``**`` for any depth (through symlinked directories, a loop entered once),
names starting with ``.`` only when the component does; :func:`walk_files` lists every file below a directory (not
through symlinked directories, as ``Path.rglob`` in Python 3.11).
"""
from __future__ import annotations

import errno
import fnmatch
import os
from pathlib import Path
from typing import Iterator

ABSENT = frozenset({errno.ENOENT, errno.ENOTDIR})  # answers: the path is not there, or not a directory
UNTOLD = ABSENT | {errno.ELOOP, errno.ENAMETOOLONG}  # answers to an entry's stat: no directory is there to list


def _absent_or_raise(e: OSError) -> None:
    if e.errno not in ABSENT:
        raise e


def walk_files(root: Path) -> Iterator[Path]:
    """Every file below ``root`` (not following symlinked directories), in no particular order; raises the OSError
    of a directory that cannot be read (one that is not there, or went while it was walked: nothing)."""
    for d, _, files in os.walk(root, onerror=_absent_or_raise):
        for f in files:
            yield Path(d) / f


def _is_dir(e: os.DirEntry) -> bool:
    """Whether the entry is a directory (through a symlink); an answer about it (a symlink loop, ELOOP) is "no", and
    any other error (EIO, ESTALE, EACCES on the stat a symlink or a file system without entry types needs) raises:
    the tree under it would vanish from the answer."""
    try:
        return e.is_dir()
    except OSError as err:
        if err.errno not in UNTOLD:
            raise
        return False


def _entries(d: Path, dirs_only: bool, named=None) -> list[os.DirEntry]:
    """The entries of ``d`` whose name ``named`` takes (all without it), only the directories among them when
    ``dirs_only``: an entry the pattern would not enter is never asked its kind."""
    try:
        with os.scandir(d) as it:
            return [e for e in it if (named is None or named(e.name)) and (not dirs_only or _is_dir(e))]
    except OSError as e:
        _absent_or_raise(e)
        return []


def _below(b: Path, files: bool) -> list[Path]:
    """``b`` and every directory below it whose name does not start with ``.``, through symlinks as glob goes, and
    their files too when ``files``: what ``**`` stands for. A link back to a directory above it (a loop, which glob
    follows until the path is too long) is not entered again."""
    out, todo = [], [(b, frozenset())]
    while todo:
        d, above = todo.pop()
        try:
            st = d.stat()
        except OSError as e:
            _absent_or_raise(e)
            continue
        if (st.st_dev, st.st_ino) in above:
            continue
        out.append(d)
        above = above | {(st.st_dev, st.st_ino)}
        for e in _entries(d, False):
            if e.name.startswith("."):
                continue
            if _is_dir(e):
                todo.append((d / e.name, above))
            elif files:
                out.append(d / e.name)
    return out


def _expand(bases: list[Path], comp: str, last: bool) -> list[Path]:
    if comp == "**":  # the base itself and every directory below it (every file too, when it ends the pattern)
        return [p for b in bases for p in _below(b, last)]
    if not glob_magic(comp):
        return [b / comp for b in bases if _there(b / comp)]
    hidden = comp.startswith(".")

    def named(name: str) -> bool:
        return (hidden or not name.startswith(".")) and fnmatch.fnmatchcase(name, comp)

    return [b / e.name for b in bases for e in _entries(b, not last, named)]


def _there(p: Path) -> bool:
    """Whether ``p`` exists (a dangling symlink too, as glob says); ``os.path.lexists`` reads any error as "no"."""
    try:
        os.lstat(p)
    except OSError as e:
        _absent_or_raise(e)
        return False
    return True


def glob_magic(s: str) -> bool:
    return any(c in s for c in "*?[")


def strict_glob(pattern: str, root: Path | None = None) -> list[Path]:
    """The paths matching ``pattern`` (absolute, or relative to ``root``, taken as it is: its name is no pattern; by
    default the working directory), sorted as strings (as ``sorted(glob.glob(…))``); raises the OSError of a
    directory on the way that cannot be read."""
    parts = Path(pattern).parts
    if not parts:
        return []
    absolute = Path(pattern).is_absolute()
    bases = [Path(parts[0])] if absolute else [Path(root) if root is not None else Path(".")]
    parts = parts[1:] if absolute else parts
    for i, comp in enumerate(parts):
        bases = _expand(bases, comp, i == len(parts) - 1)
    return [Path(p) for p in sorted({str(p) for p in bases})]
