"""Which engines a stage run may start: a run with Spark refused does what needs no Spark session and stops,
having committed nothing, where the rest would need one.

An orchestrator pays a ``spark-submit`` (a JVM and a driver; a session and its jobs where the stage starts one) for
every Spark stage it runs, also for one whose result is already committed for these inputs, or whose delta is empty
(no new input, no new doc). ``python -m <stage> --no-spark`` (:func:`pipelines.cli.stage_main`) runs the stage with
sessions refused: a committed result is reused, a result that needs no Spark is computed and committed as the stage
always does, and where the stage reaches for a session (:func:`pipelines.data.spark.get_spark` calls :func:`check`)
it stops with :class:`EngineRefused`: nothing is committed (its staging directory goes, its key lock is released,
nothing is logged), and the report, which ``--no-spark`` requires, says ``{"needs": "spark"}`` (exit 0). Then the
orchestrator submits the same command to Spark (``plugins/llm_operators.SparkStageOperator``).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

_REFUSED: list[str] = []  # process-wide, not per thread or context: a worker thread of the run is refused too


class EngineRefused(Exception):
    """A run with ``engine`` refused reached it (``what``: the session it asked for)."""

    def __init__(self, engine: str, what: str):
        super().__init__(f"{what} needs a {engine} session")
        self.engine = engine


@contextlib.contextmanager
def refused(*engines: str) -> Iterator[None]:
    """Within: :func:`check` of any of ``engines`` raises :class:`EngineRefused`."""
    _REFUSED.extend(engines)
    try:
        yield
    finally:
        for e in engines:
            _REFUSED.remove(e)


def check(engine: str, what: str) -> None:
    """Before ``engine`` starts for ``what``: :class:`EngineRefused` where this run refuses it."""
    if engine in _REFUSED:
        raise EngineRefused(engine, what)
