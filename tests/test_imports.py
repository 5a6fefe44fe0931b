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


# Imports inside functions only for what is heavy to load (issue 54): packages that take 0.25 s or more to import
# (measured with `python -c "import X"`: torch 2.2 s, mlflow 2.2, airflow 1.8, transformers 1.0, kubernetes 0.5,
# pyarrow.dataset 0.56 with pandas, scipy.sparse 0.3-0.4, pyspark 0.27 and a JVM, gguf 0.28, matplotlib 0.23,
# CEL/jsonschema 0.25 and only on Kubernetes), a project module that loads one at import, or a line that says why
# ("# lazy: …"). Everything else is imported at the top, where a reader sees the module's arrows.
HEAVY = {"torch", "pyspark", "mlflow", "transformers", "lm_eval", "kubernetes", "airflow", "matplotlib", "gguf", "boto3",
         "datasets", "huggingface_hub", "trafilatura", "numba", "tokenizers", "triton", "llama_cpp", "pandas"}
HEAVY_MODULES = ("pyarrow.dataset", "scipy", "celpy", "jsonschema")


def _imports(path: Path):
    """(node, in a function?) for every import statement of a file."""
    tree = ast.parse(path.read_text(), str(path))

    def walk(node, in_fn):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_fn
            yield from walk(child, in_fn or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    yield from walk(tree, False)


def _is_heavy(node) -> bool:
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    return any(n.split(".")[0] in HEAVY or any(n == h or n.startswith(h + ".") for h in HEAVY_MODULES) for n in names)


def heavy_at_import() -> set[str]:
    """The project's modules that load a heavy package when imported (their own top-level imports, transitively)."""
    files = {_name(p): p for p in PACKAGE.rglob("*.py")}
    own, heavy = {}, set()
    for mod, path in files.items():
        own[mod] = set()
        for node, in_fn in _imports(path):
            if in_fn:
                continue
            if _is_heavy(node):
                heavy.add(mod)
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module}.{a.name}" for a in node.names] + [node.module or ""]
            own[mod] |= {n for n in names if n in files} | {n.rpartition(".")[0] for n in names if n in files}
    changed = True
    while changed:
        changed = False
        for mod, ts in own.items():
            if mod not in heavy and ts & heavy:
                heavy.add(mod)
                changed = True
    return heavy


def test_imports_inside_functions_are_of_what_is_heavy_to_load_or_say_why():
    heavy, files = heavy_at_import(), {_name(p): p for p in PACKAGE.rglob("*.py")}
    bad = []
    for mod, path in files.items():
        lines = path.read_text().splitlines()
        for node, in_fn in _imports(path):
            if not in_fn or _is_heavy(node) or "# lazy:" in lines[node.end_lineno - 1]:
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module}.{a.name}" for a in node.names] + [node.module or ""]
            if any(n in heavy for n in names):
                continue
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "imports inside functions of what is light to load (move them to the top):\n" + "\n".join(bad)


def test_the_served_model_loads_only_what_its_requirements_declare():
    """``mlflow models serve`` builds the model's environment from ``serving.pip_requirements`` (torch,
    sentencepiece, numpy, pyarrow, pydantic, pyyaml; MLflow brings pandas): importing what the served model imports
    (the pyfunc and our text model) may load nothing else, or serving from a fresh environment fails."""
    import subprocess
    import sys

    script = ("import importlib, sys\n"
              "for m in ['mlflow.pyfunc', 'pandas', 'torch', 'sentencepiece', 'numpy', 'pyarrow', 'pydantic', 'yaml']:\n"
              "    importlib.import_module(m)\n"
              "base = {m.split('.')[0] for m in sys.modules}\n"
              "import pipelines.eval.serving, pipelines.eval.lm\n"
              "print(sorted({m.split('.')[0] for m in sys.modules} - base - set(sys.stdlib_module_names) - {'pipelines'}))")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", f"undeclared packages the served model loads: {r.stdout}"
