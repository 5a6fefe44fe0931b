"""data_curation: ingest → dedup → filter → tokenize on the spec's cron (data.schedule, default weekly); emits the Airflow Asset curated_shards.

Wiring only: the DAG is built from the stage table (pipelines/stages.py) by plugins/llm_dags.py.
"""
from llm_dags import build

dag = build("data_curation")
