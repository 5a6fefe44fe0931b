# The MLflow tracking server the cluster runs (infra/terraform var mlflow_image): the same MLflow as the pipeline's
# client (requirements.lock), with the Postgres driver for the backend and auth databases and boto3 for the S3
# artifact store. Build, push, and pin the digest `docker push` prints in envs/<env>/terraform.tfvars:
#   docker build -f infra/docker/mlflow.Dockerfile -t <account>.dkr.ecr.<region>.amazonaws.com/llm-pipeline-mlflow:3.17.2 .
#   docker push <that tag>        # → sha256:…  ⇒ mlflow_image = "<repository>@sha256:…"
FROM python:3.11-slim
RUN pip install --no-cache-dir mlflow==3.17.2 psycopg2-binary==2.9.11 boto3==1.44.5 \
 && useradd --uid 1000 --create-home mlflow
USER 1000
EXPOSE 5000
ENTRYPOINT []
