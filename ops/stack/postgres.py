"""A project-local PostgreSQL cluster (Debian's binaries, our data dir and port).

PostgreSQL refuses to run as root; when we are root the server runs as the ``postgres`` system
user created by the Debian package, and the data dir is handed to it.

Every connection, local socket or TCP, authenticates with SCRAM-SHA-256 as ``switchyard``, whose
password is the stack's secret (``StackSettings.secret("postgres")``, handed to clients in a
libpq password file). A data dir made by an older version with ``trust`` is converted on start:
the password is set, ``pg_hba.conf`` rewritten and reloaded.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
from pathlib import Path

from common.stack_settings import StackSettings
from ops.stack.process import (
    StackError,
    live_pid,
    log_tail,
    require_free_port,
    wait_until,
)


def _pg_bindir() -> Path:
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]))
    for c in reversed(candidates):
        if Path(c, "postgres").exists():
            return Path(c)
    raise StackError("PostgreSQL server binaries not found: apt-get install -y postgresql")


class PostgresService:
    name = "postgres"

    def __init__(self, settings: StackSettings) -> None:
        self.s = settings
        self.dir = settings.state_dir / "postgres"
        self.data = self.dir / "data"
        self.sock = self.dir / "run"
        self.log_file = self.dir / "postgres.log"

    def _as_owner(self, args: list[str]) -> list[str]:
        if os.geteuid() != 0:
            return args
        if not shutil.which("runuser"):
            raise StackError("running as root needs `runuser` (util-linux) to start PostgreSQL")
        return ["runuser", "-u", "postgres", "--", *args]

    def _chown(self) -> None:
        if os.geteuid() != 0:
            return
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            raise StackError("system user 'postgres' is missing: apt-get install -y postgresql") from None
        for root, dirs, files in os.walk(self.dir):
            os.chown(root, pw.pw_uid, pw.pw_gid)
            for f in files:
                os.chown(os.path.join(root, f), pw.pw_uid, pw.pw_gid)
        # The server must be able to reach its data dir through our checkout.
        p = self.dir
        while p != p.parent:
            p = p.parent
            try:
                mode = p.stat().st_mode
                if not mode & 0o001:
                    os.chmod(p, mode | 0o001)
            except PermissionError:
                break

    def ensure_installed(self) -> None:
        _pg_bindir()

    def pid(self) -> int | None:
        return live_pid(self.data / "postmaster.pid")

    def start(self, timeout: float = 60.0) -> bool:
        if self.pid():
            return False
        require_free_port(self.name, self.s.host, self.s.postgres_port, "SWITCHYARD_POSTGRES_PORT")
        bindir = _pg_bindir()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sock.mkdir(parents=True, exist_ok=True)
        fresh = not (self.data / "PG_VERSION").exists()
        if fresh:
            self.data.mkdir(parents=True, exist_ok=True)
            self._chown()
            pwfile = self.dir / "initdb.pw"  # the server's user reads it; gone right after
            pwfile.unlink(missing_ok=True)
            with os.fdopen(os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(self.s.secret("postgres") + "\n")
            self._chown()
            try:
                r = subprocess.run(
                    self._as_owner([str(bindir / "initdb"), "-D", str(self.data), "-U", "switchyard",
                                    "--auth=scram-sha-256", f"--pwfile={pwfile}", "-E", "UTF8",
                                    "--no-instructions"]),
                    capture_output=True, text=True,
                )
            finally:
                pwfile.unlink(missing_ok=True)
            if r.returncode != 0:
                raise StackError(f"initdb failed: {r.stderr or r.stdout}")
        self._chown()
        opts = (f"-p {self.s.postgres_port} -c listen_addresses={self.s.host} "
                f"-k {self.sock} -c fsync=on -c max_connections=200")
        r = subprocess.run(
            self._as_owner([str(bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.log_file),
                            "-o", opts, "-w", "-t", str(int(timeout)), "start"]),
            capture_output=True, text=True, stdin=subprocess.DEVNULL,
        )
        if r.returncode != 0:
            raise StackError(f"PostgreSQL failed to start: {r.stderr or r.stdout}\n{log_tail(self.log_file)}")
        wait_until(self.ready, timeout, 0.3, "pg_isready")
        self._require_passwords(bindir)
        if fresh:
            r = subprocess.run(
                [str(bindir / "createdb"), "-h", self.s.host, "-p", str(self.s.postgres_port),
                 "-U", "switchyard", "switchyard"], capture_output=True, text=True, env=self._client_env())
            if r.returncode != 0 and "already exists" not in r.stderr:
                raise StackError(f"createdb failed: {r.stderr}")
        return True

    def _client_env(self) -> dict[str, str]:
        return {**os.environ, "PGPASSFILE": str(self.s.pgpass_file)}

    def _require_passwords(self, bindir: Path) -> None:
        """Convert a data dir made with ``trust``: set the password, then require it."""
        hba = self.data / "pg_hba.conf"
        lines = hba.read_text().splitlines()
        if not any(ln.split()[-1:] == ["trust"] for ln in lines if ln.strip() and not ln.lstrip().startswith("#")):
            return
        r = subprocess.run(
            [str(bindir / "psql"), "-h", self.s.host, "-p", str(self.s.postgres_port), "-U", "switchyard",
             "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-q", "-f", "-"],
            input=f"SET password_encryption = 'scram-sha-256';\n"
                  f"ALTER USER switchyard PASSWORD '{self.s.secret('postgres')}';\n",
            capture_output=True, text=True)
        if r.returncode != 0:
            raise StackError(f"setting the PostgreSQL password failed: {r.stderr}")
        out = [" ".join([*ln.split()[:-1], "scram-sha-256"]) if ln.strip() and not ln.lstrip().startswith("#")
               and ln.split()[-1] == "trust" else ln for ln in lines]
        hba.write_text("\n".join(out) + "\n")
        r = subprocess.run(self._as_owner([str(bindir / "pg_ctl"), "-D", str(self.data), "reload"]),
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise StackError(f"PostgreSQL reload failed: {r.stderr or r.stdout}")

    def ready(self) -> bool:
        r = subprocess.run(
            [str(_pg_bindir() / "pg_isready"), "-h", self.s.host, "-p", str(self.s.postgres_port),
             "-U", "switchyard"], capture_output=True, text=True)
        return r.returncode == 0

    def stop(self, timeout: float = 30.0) -> None:
        if not self.pid():
            return
        subprocess.run(
            self._as_owner([str(_pg_bindir() / "pg_ctl"), "-D", str(self.data), "-m", "fast",
                            "-w", "-t", str(int(timeout)), "stop"]),
            capture_output=True, text=True,
        )
        wait_until(lambda: self.pid() is None, timeout, 0.2, "PostgreSQL to stop")

    def status(self) -> dict:
        pid = self.pid()
        return {"service": self.name, "running": bool(pid), "pid": pid,
                "address": self.s.postgres_url, "data": str(self.data)}
