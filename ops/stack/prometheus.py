"""A project-local Prometheus (Debian's binary, our data dir, config and port).

The scrape config is ``dashboards/prometheus.yml`` rendered with this instance's targets
directory and scrape interval. Targets are file_sd JSON files in that directory, one per process
(``control_plane.metrics.exposition.write_targets``, which the processes call); Prometheus re-reads them when they change, so processes come and go
without a restart. On first start the defaults in ``dashboards/targets/`` are copied there.
"""

from __future__ import annotations

import os
import shutil
import urllib.request
from pathlib import Path

from control_plane.metrics.exposition import write_targets
from common.stack_settings import StackSettings
from ops.stack.process import (
    StackError,
    live_pid,
    require_free_port,
    start_daemon,
    terminate,
)
from common.settings import repo_root

__all__ = ["PrometheusService", "render_config", "write_targets"]

TEMPLATE = Path("dashboards") / "prometheus.yml"
DEFAULT_TARGETS = Path("dashboards") / "targets"


def render_config(template: str, *, targets_dir: Path, scrape_interval: str, self_address: str) -> str:
    """Fill the template's ``{{ targets_dir }}``, ``{{ scrape_interval }}`` and
    ``{{ self_address }}``; refuse a template with anything else left to fill."""
    out = (template.replace("{{ targets_dir }}", str(targets_dir))
           .replace("{{ scrape_interval }}", scrape_interval)
           .replace("{{ self_address }}", self_address))
    if "{{" in out:
        line = next(x for x in out.splitlines() if "{{" in x)
        raise StackError(f"prometheus template has an unknown placeholder: {line.strip()}")
    return out


class PrometheusService:
    name = "prometheus"

    def __init__(
        self,
        settings: StackSettings,
        *,
        scrape_interval: str = "15s",
        targets_dir: Path | None = None,
        retention: str = "15d",
        seed_targets: bool = True,
    ) -> None:
        self.s = settings
        self.dir = settings.state_dir / "prometheus"
        self.data_dir = self.dir / "data"
        self.config_file = self.dir / "prometheus.yml"
        self.targets_dir = targets_dir or self.dir / "targets"
        self.pid_file = self.dir / "prometheus.pid"
        self.log_file = self.dir / "prometheus.log"
        self.scrape_interval = scrape_interval
        self.retention = retention
        self.seed_targets = seed_targets

    @property
    def listen(self) -> str:
        return f"{self.s.host}:{self.s.prometheus_port}"

    @property
    def url(self) -> str:
        return f"http://{self.listen}"

    def ensure_installed(self) -> str:
        binary = shutil.which("prometheus")
        if not binary:
            raise StackError("prometheus not found: apt-get install -y prometheus")
        return binary

    def pid(self) -> int | None:
        return live_pid(self.pid_file)

    def write_config(self) -> Path:
        template = (repo_root() / TEMPLATE).read_text()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.targets_dir.mkdir(parents=True, exist_ok=True)
        if self.seed_targets:
            for default in sorted((repo_root() / DEFAULT_TARGETS).glob("*.json")):
                dst = self.targets_dir / default.name
                if not dst.exists():
                    shutil.copyfile(default, dst)
        self.config_file.write_text(render_config(template, targets_dir=self.targets_dir,
                                                  scrape_interval=self.scrape_interval, self_address=self.listen))
        return self.config_file

    def start(self, timeout: float = 30.0) -> bool:
        """Start unless running. Returns True if it started a new process."""
        if self.pid():
            return False
        require_free_port(self.name, self.s.host, self.s.prometheus_port, "SWITCHYARD_PROMETHEUS_PORT")
        binary = self.ensure_installed()
        cfg = self.write_config()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        start_daemon("Prometheus", [binary, f"--config.file={cfg}", f"--storage.tsdb.path={self.data_dir}",
                                    f"--storage.tsdb.retention.time={self.retention}",
                                    f"--web.listen-address={self.listen}", "--log.level=warn"],
                     log_file=self.log_file, pid_file=self.pid_file, ready=self.ready, stop=self.stop,
                     timeout=timeout)
        return True

    def ready(self) -> bool:
        with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
            return r.status == 200

    def reload(self) -> None:
        """Re-read the config (SIGHUP); target files need no reload."""
        pid = self.pid()
        if pid is None:
            raise StackError("prometheus is not running")
        self.write_config()
        os.kill(pid, 1)

    def stop(self, timeout: float = 20.0) -> None:
        pid = self.pid()
        if pid:
            terminate(pid, timeout)  # SIGTERM: Prometheus flushes its head block and exits
        self.pid_file.unlink(missing_ok=True)

    def status(self) -> dict:
        pid = self.pid()
        return {"service": self.name, "running": bool(pid), "pid": pid, "address": self.url,
                "data": str(self.data_dir), "targets": str(self.targets_dir)}
