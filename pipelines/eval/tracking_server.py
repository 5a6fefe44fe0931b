"""The MLflow tracking server as the cluster runs it (modules/metadata's Deployment calls exactly this), from the
pipeline image: ``mlflow server`` with the Host headers and CORS origins its clients use.

MLflow (3.5 and later) answers 403 "Invalid Host header" to every request whose Host is not allowed, and by default
allows only localhost and private IPs: a pod that calls the Service by its DNS name
(``http://mlflow.mlflow.svc.cluster.local:5000``, the URI Terraform hands the pipeline) would be refused, while the
kubelet's probes of ``/health`` (exempt) still pass. Here the allowed hosts are the Service's every DNS form —
``NAME``, ``NAME.NS``, ``NAME.NS.svc``, ``NAME.NS.svc.CLUSTER_DOMAIN`` — with and without the port, plus MLflow's
defaults (localhost for ``kubectl port-forward``, private IPs for the pod's own address); CORS origins are the same
names over http and https (MLflow always allows localhost origins).

    python -m pipelines.eval.tracking_server --service mlflow --namespace mlflow --port 5000 \\
        --backend-store-uri-file /var/run/secrets/metadata-db/connection \\
        --artifacts-destination s3://BUCKET/artifacts --app-name basic-auth
    python -m pipelines.eval.tracking_server … --print        # the mlflow command line, as JSON, without running it
                                                              # (the database URI is not on it)

The backend store's URI is read from a file (the Secret's mount) and handed to mlflow in its environment
(``MLFLOW_BACKEND_STORE_URI``), so the database password is never on a command line. Exit 2: a flag or that file is
wrong; 75: mlflow could not be started.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pipelines.exit_codes import RETRY, USER_ERROR
from pipelines.storage import oserrors


def service_hosts(service: str, namespace: str, port: int, cluster_domain: str = "cluster.local") -> list[str]:
    """Every Host header a client inside the cluster sends for the Service: each DNS form, with and without port."""
    names = [service, f"{service}.{namespace}", f"{service}.{namespace}.svc",
             f"{service}.{namespace}.svc.{cluster_domain}"]
    return [h for name in names for h in (name, f"{name}:{port}")]


def allowed_hosts(service: str, namespace: str, port: int, cluster_domain: str = "cluster.local") -> list[str]:
    from mlflow.server.security_utils import get_default_allowed_hosts

    return service_hosts(service, namespace, port, cluster_domain) + get_default_allowed_hosts()


def cors_origins(service: str, namespace: str, port: int, cluster_domain: str = "cluster.local") -> list[str]:
    """The Service's names as browser origins (MLflow always allows localhost origins besides these)."""
    return [f"{scheme}://{h}" for scheme in ("http", "https") for h in service_hosts(service, namespace, port,
                                                                                       cluster_domain)]


def command(args: argparse.Namespace) -> list[str]:
    """The mlflow command line; the backend store's URI is not on it (MLFLOW_BACKEND_STORE_URI: see main)."""
    cmd = ["mlflow", "server", "--host", args.host, "--port", str(args.port), "--workers", str(args.workers),
           "--allowed-hosts", ",".join(allowed_hosts(args.service, args.namespace, args.port, args.cluster_domain)),
           "--cors-allowed-origins", ",".join(cors_origins(args.service, args.namespace, args.port,
                                                            args.cluster_domain))]
    if args.artifacts_destination:
        cmd += ["--artifacts-destination", args.artifacts_destination, "--serve-artifacts"]
    if args.app_name:
        cmd += ["--app-name", args.app_name]
    return cmd


def _port(text: str) -> int:
    n = _positive(text)
    if n > 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a port (1-65535)")
    return n


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a whole number of at least 1")
    return int(text)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m pipelines.eval.tracking_server",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--service", required=True, help="The Kubernetes Service's name (mlflow).")
    ap.add_argument("--namespace", required=True, help="Its namespace (mlflow).")
    ap.add_argument("--port", type=_port, default=5000, help="The port the Service and the server listen on.")
    ap.add_argument("--cluster-domain", default="cluster.local", help="The cluster's DNS domain (cluster.local).")
    ap.add_argument("--host", default="0.0.0.0", help="The address the server binds (0.0.0.0 in a pod).")
    ap.add_argument("--workers", type=_positive, default=4, help="MLflow's worker processes.")
    store = ap.add_mutually_exclusive_group(required=True)
    store.add_argument("--backend-store-uri-file", help="A file holding the backend store's URI (a Secret's mount).")
    store.add_argument("--backend-store-uri", help="The backend store's URI itself (local use; it shows in ps).")
    ap.add_argument("--artifacts-destination", help="Where proxied artifacts go (s3://BUCKET/artifacts).")
    ap.add_argument("--app-name", help="MLflow's app: basic-auth for logins (MLFLOW_AUTH_CONFIG_PATH).")
    ap.add_argument("--print", action="store_true", help="Print the mlflow command as JSON and exit.")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    uri = args.backend_store_uri
    if args.backend_store_uri_file:
        try:
            uri = Path(args.backend_store_uri_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:  # a mounted Secret that storage did not return: a retry (75)
            print(f"tracking_server: error: cannot read --backend-store-uri-file: {e}", file=sys.stderr)
            return RETRY if oserrors.storage_failing(e) else USER_ERROR
    if not uri:
        print("tracking_server: error: the backend store's URI is empty", file=sys.stderr)
        return USER_ERROR
    cmd = command(args)
    if args.print:
        print(json.dumps(cmd))
        return 0
    # the URI (it holds the database password) goes by the environment, which mlflow's --backend-store-uri reads:
    # never on a command line, where ps and /proc/<pid>/cmdline of the server's processes would show it
    try:
        os.execvpe(cmd[0], cmd, {**os.environ, "MLFLOW_BACKEND_STORE_URI": uri})
    except OSError as e:
        print(f"tracking_server: error: cannot start {cmd[0]}: {e}", file=sys.stderr)
        return RETRY
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
