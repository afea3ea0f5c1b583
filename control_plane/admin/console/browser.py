"""Debian's headless Chromium driven through chromium-driver (Selenium), for the console's
browser tests and ``switchyard console-check``: no browser download, the system's binaries.

Console messages are read through the driver's browser log; ``errors`` are the SEVERE ones
(uncaught exceptions, failed loads, Content-Security-Policy violations)."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
DRIVER = ("chromedriver",)


def _which(names: tuple[str, ...], what: str) -> str:
    for n in names:
        p = shutil.which(n) or (f"/usr/bin/{n}" if Path(f"/usr/bin/{n}").exists() else None)
        if p:
            return p
    raise RuntimeError(f"{what} not found (apt-get install chromium chromium-driver; scripts/install-deps.sh does)")


@dataclass
class Browser:
    driver: object
    #: The browser's own temporary directory (its TMPDIR and profile), removed at :meth:`close`:
    #: Chromium leaves an ``org.chromium.Chromium.*`` directory in TMPDIR at every start.
    tmp: Path | None = None
    #: Every SEVERE console message seen so far, with the page it came from.
    errors: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, width: int = 1400, height: int = 1000) -> Browser:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        tmp = Path(tempfile.mkdtemp(prefix="switchyard-chromium-"))
        opts = webdriver.ChromeOptions()
        opts.binary_location = _which(CHROMIUM, "chromium")
        for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  f"--window-size={width},{height}", "--no-first-run", "--disable-extensions",
                  f"--user-data-dir={tmp / 'profile'}"):
            opts.add_argument(a)
        opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        service = Service(_which(DRIVER, "chromedriver"), env={**os.environ, "TMPDIR": str(tmp)})
        try:
            drv = webdriver.Chrome(service=service, options=opts)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        drv.set_page_load_timeout(30)
        return cls(drv, tmp)

    def get(self, url: str) -> None:
        self.driver.get(url)

    def console(self) -> list[dict]:
        """Console messages since the last call (the driver's log is read once)."""
        entries = self.driver.get_log("browser")
        self.errors.extend(f"{e['message']}" for e in entries if e.get("level") == "SEVERE")
        return entries

    def new_errors(self) -> list[str]:
        before = len(self.errors)
        self.console()
        return self.errors[before:]

    def login(self, base: str, token: str) -> None:
        from selenium.webdriver.common.by import By

        self.get(f"{base}/console/login")
        box = self.driver.find_element(By.ID, "token")
        box.clear()
        box.send_keys(token)
        box.submit()

    def screenshot(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.driver.save_screenshot(str(path))
        return path

    def close(self) -> None:
        try:
            self.driver.quit()
        finally:
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
