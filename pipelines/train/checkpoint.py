"""A committed checkpoint as a plain state dict: ``python -m pipelines.train.checkpoint export SRC OUT.pt`` (the
register stage runs it on the launcher's ranks for a big model). The checkpoint protocol itself is
:mod:`pipelines.train.ckpt`.
"""
from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path

from pipelines.exit_codes import USER_ERROR
from pipelines.procs import main_bounded
from pipelines.train.ckpt.dcp_read import load_plain_model
from pipelines.train.ckpt.protocol import CheckpointError, verify_local


def export(src: Path, out: Path) -> int:
    """Write ``{name: tensor}`` (what ``Transformer.load_state_dict`` takes, strictly) from a committed local
    checkpoint; returns the number of tensors."""
    import torch

    verify_local(src)
    sd = load_plain_model(src).state_dict()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    torch.save(sd, tmp)
    os.replace(tmp, out)
    return len(sd)


def export_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.train.checkpoint export",
                                 description="Write a consolidated plain state dict ({name: tensor}, loadable strictly "
                                 "by Transformer.load_state_dict) from a committed local checkpoint directory.")
    ap.add_argument("src", help="A committed checkpoint directory (step-NNNNNN with MANIFEST.json and COMMIT).")
    ap.add_argument("out", help="Output .pt file.")
    a = ap.parse_args(argv)
    if os.environ.get("RANK", "0") != "0":  # on the launcher's ranks (register of a big model): the first one writes
        return 0
    try:
        n = export(Path(a.src), Path(a.out))
    except (CheckpointError, FileNotFoundError) as e:
        print(f"export: error: {e}", file=sys.stderr)
        return USER_ERROR
    print(f"export: {n} tensors → {a.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["export"]:
        print("usage: python -m pipelines.train.checkpoint export SRC OUT.pt\n(the promote stage is "
              "python -m pipelines.train.promote)", file=sys.stderr)
        return USER_ERROR
    return export_main(argv[1:])


if __name__ == "__main__":
    main_bounded(main)  # a thread stuck in I/O at the end keeps the process at most procs.EXIT_GRACE_S
