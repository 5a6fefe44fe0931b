"""The house's import graph (issue 54), read from the code itself: every ``import`` of a ``pipelines`` module, at
module level or inside a function (an AST walk; nothing is imported). Two rules, held as a ratchet: no import
circle, and no import from a lower layer into a higher one (foundations < data < launch < train < eval < the applications
over them). The circles and upward imports that the house still has are listed below; issue 54 removes them, so
the lists may only shrink: a new one fails, and so does one that is gone but still listed."""
import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "pipelines"
PLANES = {"pipelines.data": 1, "pipelines.launch": 2, "pipelines.train": 3, "pipelines.eval": 4}  # below: foundations (0)
APPLICATIONS = {"pipelines.summary"}  # over every plane (5)
KNOWN_CIRCLES: set[frozenset] = set()  # issue 54 removed the last four
KNOWN_UPWARD: set[tuple[str, str]] = set()  # issue 54 removed the last two (the evaluation sets moved to the root)


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """{module: the project's modules it imports}."""
    files = {_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's own package up
                    up = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        graph[mod] = {m for m in found if m in files and m != mod}
    return graph


def circles(graph: dict[str, set[str]]) -> set[frozenset]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), set(), [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.add(frozenset(comp))
    return out


def layer(mod: str) -> int:
    if mod in APPLICATIONS:
        return 5
    return next((n for p, n in PLANES.items() if mod == p or mod.startswith(p + ".")), 0)


def test_the_graph_is_read_from_the_code():
    graph = import_graph()
    assert "pipelines.train.trainer" in graph and "pipelines.train.model" in graph["pipelines.train.trainer"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset("abc")}
    assert circles({"a": {"b"}, "b": set()}) == set()


def test_no_new_import_circle_and_none_listed_that_is_gone():
    found = circles(import_graph())
    new, gone = found - KNOWN_CIRCLES, KNOWN_CIRCLES - found
    assert not new, f"new import circle(s): {[sorted(c) for c in new]}"
    assert not gone, f"circle(s) no longer in the code: remove them from KNOWN_CIRCLES: {[sorted(c) for c in gone]}"


def test_no_new_import_from_a_lower_layer_into_a_higher_one():
    graph = import_graph()
    upward = {(m, t) for m, ts in graph.items() for t in ts if layer(t) > layer(m)}
    new, gone = upward - KNOWN_UPWARD, KNOWN_UPWARD - upward
    assert not new, f"new upward import(s) (foundations < data < launch < train < eval < applications): {sorted(new)}"
    assert not gone, f"upward import(s) no longer in the code: remove them from KNOWN_UPWARD: {sorted(gone)}"
