"""What pip prints when the package index did not answer, as opposed to answering without what was asked for:
then a retry may do (exit 75). Shared by ``lock_check.py`` and ``gpu_bundle.py`` (each run as a script from this
folder, which is then first on ``sys.path``)."""
from __future__ import annotations

NETWORK_ERRORS = ("Could not fetch URL", "Max retries exceeded", "NewConnectionError", "ConnectTimeoutError",
                  "ReadTimeoutError", "Temporary failure in name resolution", "Network is unreachable",
                  "Connection refused", "Connection reset", "ProxyError")  # not SSLError: a certificate is configuration


def unanswered(stderr: str) -> bool:
    """Did pip fail because the index did not answer?"""
    return any(m in stderr for m in NETWORK_ERRORS)
