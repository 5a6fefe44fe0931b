"""training: preflight → train → promote, scheduled on the Airflow Asset curated_shards; emits the Asset checkpoint.

Wiring only: the DAG is built from the stage table (pipelines/stages.py) by plugins/llm_dags.py.
"""
from llm_dags import build

dag = build("training")
