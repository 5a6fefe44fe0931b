"""Debian's PostgreSQL for the contract tests, started by the test like the S3 endpoint: a fresh cluster (initdb) in a
temporary directory, listening on 127.0.0.1 only, TLS on (the cluster's DSNs say ``sslmode=require``; RDS answers
TLS), one login and database per application as modules/metadata's logins job makes them.

Installed by `make postgres` (apt, as `make browser` installs chromium); a machine without it skips these tests and
says why. PostgreSQL refuses to run as root: as root the server runs as Debian's ``postgres`` user."""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import quote

import pytest

from conftest import free_port


def _bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


class Postgres:
    """A running server; ``dsn(role, db)`` is the connection string the cluster's Secrets hold for it."""

    def __init__(self):
        self.bin = _bin_dir()
        if self.bin is None or shutil.which("psql") is None:
            pytest.skip("PostgreSQL is not installed here (make postgres installs Debian's package)")
        # its own folder, reachable by the server's user (pytest's are private to root)
        self.root, self.port = Path(tempfile.mkdtemp(prefix="llmp-pg-")), free_port()
        os.chmod(self.root, 0o755)
        self.data = self.root / "data"
        self.user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
        self.passwords: dict[str, str] = {}

    def _as_owner(self, *cmd: str, **kw) -> subprocess.CompletedProcess:
        prefix = ["runuser", "-u", self.user, "--"] if os.geteuid() == 0 else []
        return subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=120, **kw)

    def start(self) -> "Postgres":
        if os.geteuid() == 0:
            shutil.chown(self.root, self.user)
        pwfile = self.root / "admin.pw"
        pwfile.write_text("admin-pw\n")
        if os.geteuid() == 0:
            shutil.chown(pwfile, self.user)
        r = self._as_owner(str(self.bin / "initdb"), "-D", str(self.data), "-U", "admin", "--auth=scram-sha-256",
                           f"--pwfile={pwfile}", "-E", "UTF8", "--locale=C.UTF-8")
        pwfile.unlink()
        assert r.returncode == 0, r.stdout + r.stderr
        self.passwords["admin"] = "admin-pw"
        self._tls()
        conf = (f"listen_addresses = '127.0.0.1'\nport = {self.port}\nunix_socket_directories = '{self.root}'\n"
                "ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\nmax_connections = 200\n"
                "fsync = off\nsynchronous_commit = off\n")
        (self.data / "postgresql.conf").write_text(conf)
        # TLS required for TCP clients (as RDS's rds.force_ssl), password logins only
        (self.data / "pg_hba.conf").write_text("hostssl all all 127.0.0.1/32 scram-sha-256\n"
                                               "local all admin scram-sha-256\n")
        r = self._as_owner(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "server.log"),
                           "-w", "-t", "120", "start")
        if r.returncode != 0:  # a server still starting after the wait is stopped, not left behind
            log = (self.root / "server.log").read_text() if (self.root / "server.log").exists() else ""
            self.stop()
            raise AssertionError(f"PostgreSQL did not start: {r.stdout}{r.stderr}{log[-2000:]}")
        return self

    def _tls(self) -> None:
        r = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                            "/CN=127.0.0.1", "-keyout", str(self.data / "server.key"), "-out",
                            str(self.data / "server.crt")], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        os.chmod(self.data / "server.key", 0o600)
        if os.geteuid() == 0:
            for f in ("server.key", "server.crt"):
                shutil.chown(self.data / f, self.user)

    def psql(self, sql: str, db: str = "postgres") -> str:
        r = subprocess.run(["psql", self.dsn("admin", db), "-v", "ON_ERROR_STOP=1", "-tAc", sql],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    def app(self, role: str, databases: list[str]) -> None:
        """A login owning its databases, as the logins job in modules/metadata makes them."""
        self.passwords[role] = f"{role}-pw-{free_port()}"
        self.psql(f"CREATE ROLE \"{role}\" LOGIN PASSWORD '{self.passwords[role]}'")
        for db in databases:
            self.psql(f"CREATE DATABASE \"{db}\" OWNER \"{role}\"")
            self.psql(f"REVOKE ALL ON DATABASE \"{db}\" FROM PUBLIC")

    def dsn(self, role: str, db: str) -> str:
        """The modules/metadata shape: ``postgresql://ROLE:PASSWORD@HOST:PORT/DB?sslmode=require``."""
        return f"postgresql://{role}:{quote(self.passwords[role], safe='')}@127.0.0.1:{self.port}/{db}?sslmode=require"

    def __enter__(self) -> "Postgres":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._as_owner(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "-t", "60", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

