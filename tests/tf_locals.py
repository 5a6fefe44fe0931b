"""A Terraform module's ``locals`` as values, for the contract tests that run what Terraform hands a component (args,
paths) in the image: strings and lists of strings, with ``${var.X}`` / ``${local.X}`` replaced from a mapping the
test gives (the values a cluster's variables would take). A local that is any other expression is left out."""
from __future__ import annotations

import re
from pathlib import Path

import hcl2

REF = re.compile(r"\$\{((?:var|local)\.[A-Za-z0-9_.]+)\}")


def _string(raw, refs: dict[str, str]):
    if not isinstance(raw, str):
        return None
    if len(raw) >= 2 and raw[0] == raw[-1] == '"':
        raw = raw[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    elif not REF.fullmatch(raw):
        return None  # a function call or another expression
    unknown = [m for m in REF.findall(raw) if m not in refs]
    if unknown:
        return None
    return REF.sub(lambda m: refs[m.group(1)], raw)


def module_locals(path: Path, refs: dict[str, str]) -> dict:
    """``{name: str | list[str]}`` of every local of the .tf file at ``path`` that is a string or a list of them."""
    with open(path) as f:
        doc = hcl2.load(f)
    out: dict = {}
    for block in doc.get("locals", []):
        for name, raw in block.items():
            if name.startswith("__"):
                continue
            value = ([_string(r, {**refs, **{f"local.{k}": v for k, v in out.items() if isinstance(v, str)}})
                      for r in raw] if isinstance(raw, list) else
                     _string(raw, {**refs, **{f"local.{k}": v for k, v in out.items() if isinstance(v, str)}}))
            if value is not None and (not isinstance(value, list) or None not in value):
                out[name] = value
    return out
