"""A private PostgreSQL server for tests: `initdb` + `pg_ctl` in a temporary folder.

Debian's `postgresql` package puts its binaries in /usr/lib/postgresql/<major>/bin (not
on PATH); other systems put `initdb` on PATH. The server listens on 127.0.0.1 at a free
port with its socket in the same folder, trusts local connections (a throwaway cluster)
and is stopped and deleted by `stop()`. PostgreSQL refuses to run as root, so when the
tests run as root the cluster is owned by, and run as, the `postgres` user (`runuser`).
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MISSING = ("PostgreSQL server binaries (initdb, pg_ctl) not found; install them with "
           "`apt-get install -y postgresql` (.ci/run does)")


def find_bindir() -> Path | None:
    """Folder holding initdb and pg_ctl: the newest Debian major version, else PATH."""
    debian = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                    key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    if debian:
        return Path(debian[-1]).parent
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return Path(initdb).parent
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PostgresServer:
    root: Path
    port: int
    bindir: Path
    run_as: str | None        # a user to run the server as (we are root), else None

    @property
    def data(self) -> Path:
        return self.root / "data"

    def url(self, database: str, driver: str = "") -> str:
        """SQLAlchemy URL of `database` (driver e.g. "+psycopg2"; "" = its default, psycopg2)."""
        return f"postgresql{driver}://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> None:
        import psycopg2

        connection = psycopg2.connect(host="127.0.0.1", port=self.port, user="postgres",
                                      dbname="postgres")
        connection.autocommit = True          # CREATE DATABASE cannot run in a transaction
        try:
            with connection.cursor() as cursor:
                cursor.execute(f'CREATE DATABASE "{name}"')
        finally:
            connection.close()

    def log(self) -> str:
        path = self.root / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def _cmd(self, *args: str) -> list[str]:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        return ["runuser", "-u", self.run_as, "--", *cmd] if self.run_as else cmd

    def start(self, timeout_s: float = 60) -> "PostgresServer":
        subprocess.run(self._cmd("initdb", "-D", str(self.data), "-U", "postgres",
                                 "--auth=trust", "-E", "UTF8", "--no-sync"),
                       check=True, capture_output=True, text=True, timeout=timeout_s)
        # fsync off: a throwaway cluster; durability against power loss is not under test.
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
                   f"-c fsync=off -c max_connections=200")
        subprocess.run(self._cmd("pg_ctl", "-D", str(self.data), "-o", options,
                                 "-l", str(self.root / "server.log"), "-w", "-t",
                                 str(int(timeout_s)), "start"),
                       check=True, capture_output=True, text=True, timeout=timeout_s + 10)
        deadline = time.monotonic() + timeout_s
        while True:                             # -w waits for the socket; wait for TCP too
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"postgres did not listen on {self.port}: {self.log()[-2000:]}")
                time.sleep(0.2)

    def stop(self) -> None:
        if self.data.exists():
            subprocess.run(self._cmd("pg_ctl", "-D", str(self.data), "-m", "fast", "-w",
                                     "stop"), capture_output=True, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)


def make_server() -> PostgresServer | None:
    """A configured (not yet started) server in a fresh folder, or None without binaries."""
    bindir = find_bindir()
    if bindir is None:
        return None
    run_as = None
    # pytest's tmp_path is private to root (0700): use a folder the server's user can reach.
    root = Path(tempfile.mkdtemp(prefix="sweeper-pg-"))
    if os.geteuid() == 0:
        run_as = "postgres"
        shutil.chown(root, user=run_as)
    return PostgresServer(root=root, port=free_port(), bindir=bindir, run_as=run_as)
