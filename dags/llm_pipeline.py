"""llm_pipeline: every stage in one Airflow DAG, raw web text to a registered model (the one-click demo).

Wiring only: the DAG is built from the stage table (pipelines/stages.py) by plugins/llm_dags.py.
"""
from llm_dags import build

dag = build("llm_pipeline")
