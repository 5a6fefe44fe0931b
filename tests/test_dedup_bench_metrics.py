"""The benchmark's quality metrics on a hand-built chain, where the right answers are known."""
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "dedup_bench.py"
    spec = importlib.util.spec_from_file_location("dedup_bench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["dedup_bench"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def chain(bench):
    # docs 0–1–2 a chain at J ≥ 0.8 (J(0,2) = 0.6), doc 3 alone, doc 4 an exact copy of 3
    return bench.Corpus([f"d{i}" for i in range(5)], [""] * 5, ["x"] * 5,
                        np.array([0, 1, 0, 3]), np.array([1, 2, 2, 4]), np.array([0.85, 0.85, 0.6, 1.0]))


def test_min_id_on_a_chain_loses_precision_and_a_cover_does_not(bench):
    c = chain(bench)
    # min id: one cluster {0,1,2}, keeps 0, removes 1 and 2 (2 is not similar to 0) and 4
    m = bench.evaluate(c, np.array([0, 0, 0, 3, 3]), np.array([False, True, True, False, True]))
    assert m["pair_recall"] == 1.0
    assert m["pair_precision"] == pytest.approx(3 / 4)  # predicted pairs 01 02 12 34; 02 is false
    assert m["removal_precision"] == pytest.approx(2 / 3)  # doc 2 has no kept doc with J ≥ 0.8
    # cover: keep 1, remove 0 and 2 next to it
    m = bench.evaluate(c, np.array([1, 1, 1, 3, 3]), np.array([True, False, True, False, True]))
    assert m["removal_precision"] == 1.0 and m["removal_recall"] == 1.0
    # removing nothing: precision vacuous, recall 0
    m = bench.evaluate(c, np.arange(5), np.zeros(5, bool))
    assert m["removal_recall"] == 0.0 and m["pair_recall"] == 0.0
