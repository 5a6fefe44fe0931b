"""spark-submit entry point: ``spark-submit … pipelines/spark_entry.py <module> [args…]``.

spark-submit runs a *file*, which puts that file's folder first on ``sys.path``. Submitting a
stage module directly would let ``pipelines/data/tokenize.py`` shadow the standard library's
``tokenize``; this entry drops its own folder from the path, puts the project root there instead
(a ``--py-files`` zip of ``pipelines`` serves on a cluster), and runs the named stage module as
``__main__``.
"""
import os
import runpy
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
_root = os.path.dirname(_here)
if os.path.isdir(os.path.join(_root, "pipelines")) and _root not in sys.path:
    sys.path.insert(1, _root)

if __name__ == "__main__":
    if len(sys.argv) < 2 or not sys.argv[1].startswith("pipelines."):
        sys.exit("usage: spark-submit pipelines/spark_entry.py pipelines.<stage module> [args...]")
    module = sys.argv[1]
    sys.argv = [module] + sys.argv[2:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
