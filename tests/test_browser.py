"""Browser smoke test: `make lab` opens the welcome notebook on the labkit kernel, and it runs.

It starts the real `make lab` (which adds --allow-root itself when run as root): LAB_ARGS
only pin a loopback port and a random token, keep JupyterLab off the network, and keep its settings, layout and checkpoints in a
temporary directory. It checks over REST that the `labkit` kernelspec is served, opens
notebooks/00_welcome.ipynb in Debian's chromium, waits until the notebook shows
"Python (labkit)" and the kernel is idle, runs the first code cell with Shift+Enter and checks
that it finished with no stderr output (JupyterLab 4 renders a traceback as stderr too).
Autosave is off for the run, so the notebook file is left exactly as it was.

Needs `chromium` on PATH (Debian: apt-get install chromium; never `playwright install`).
Without it the test skips, unless CI is set: then it fails.
"""
from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from playwright.sync_api import Page, expect, sync_playwright

# `jupyter lab notebooks/00_welcome.ipynb` serves notebooks/ as its root directory.
NOTEBOOK = "00_welcome.ipynb"
KERNEL = "Python (labkit)"
SERVER_START_S = 60
UI_TIMEOUT_MS = 60_000
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# User settings for this run only: no "Jupyter news?" prompt (so no update check either)
# and no autosave, which would write the executed cell back into the student's notebook.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
}


class Lab(NamedTuple):
    base: str
    token: str

    def url(self, path: str) -> str:
        return f"{self.base}{path}?token={self.token}"


def _chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        reason = "Debian's chromium is not on PATH (apt-get install chromium)"
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"{reason}; CI is set, so the browser smoke test may not skip")
        pytest.skip(reason)
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _lab_args(port: int, token: str, tmp_path: Path) -> list[str]:
    settings = tmp_path / "user-settings"
    for plugin, values in LAB_SETTINGS.items():
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    return [
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",  # fail, rather than quietly serve on another port
        f"--IdentityProvider.token={token}",
        "--LabApp.news_url=None",
        "--LabApp.extension_manager=readonly",  # the default "pypi" manager queries PyPI
        f"--LabApp.user_settings_dir={settings}",
        f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",  # no layout left from an earlier run
        # Opening a notebook writes a checkpoint of it; keep that out of notebooks/.
        f"--FileCheckpoints.checkpoint_dir={tmp_path / 'checkpoints'}",
    ]


def _get_json(lab: Lab, path: str) -> Any:
    with urllib.request.urlopen(lab.url(path), timeout=5) as response:
        return json.load(response)


def _wait_for_server(lab: Lab, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"make lab exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            _get_json(lab, "/api/status")
            return
        except OSError:
            time.sleep(0.25)
    pytest.fail(f"JupyterLab did not answer within {SERVER_START_S} s:\n{log.read_text()[-4000:]}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the group (make waits for jupyter, which shuts its kernel down); then SIGKILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)
    except ProcessLookupError:
        proc.wait(timeout=5)


@pytest.fixture
def page() -> Iterator[Page]:
    executable = _chromium()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=executable, headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(UI_TIMEOUT_MS)
            yield page
        finally:
            browser.close()


@pytest.fixture
def lab(root: Path, tmp_path: Path) -> Iterator[Lab]:
    """The real `make lab` on a free loopback port, killed with its whole process group."""
    if subprocess.run(["make", "-q", "install"], cwd=root).returncode != 0:
        pytest.fail("the install is missing or older than pyproject.toml: run `make install` first")
    port, token = _free_port(), secrets.token_hex(16)
    log = tmp_path / "make-lab.log"
    command = ["make", "lab", "LAB_ARGS=" + shlex.join(_lab_args(port, token, tmp_path))]
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, cwd=root, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        lab = Lab(f"http://127.0.0.1:{port}", token)
        _wait_for_server(lab, proc, log)
        yield lab
    finally:
        _stop(proc)


def _wait_for_idle_kernel(page: Page) -> None:
    expect(page.locator(".jp-NotebookPanel")).to_have_count(1, timeout=UI_TIMEOUT_MS)
    tab = page.locator("#jp-main-dock-panel .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel")
    expect(tab).to_have_text(NOTEBOOK, timeout=UI_TIMEOUT_MS)
    toolbar_kernel = page.locator('.jp-NotebookPanel-toolbar [data-jp-item-name="kernelName"]')
    expect(toolbar_kernel).to_have_text(KERNEL, timeout=UI_TIMEOUT_MS)
    # The toolbar's execution indicator reads "idle" before the kernel has even connected;
    # the status bar's "<kernel> | <status>" item does not.
    status = page.locator("#jp-main-statusbar").get_by_text(f"{KERNEL} | Idle", exact=True)
    expect(status).to_be_visible(timeout=UI_TIMEOUT_MS)


def _run_first_code_cell(page: Page) -> None:
    cell = page.locator(".jp-NotebookPanel .jp-CodeCell").first
    cell.locator(".cm-content").click()
    page.keyboard.press("Shift+Enter")
    # "[*]:" while it runs; "[1]:" once the reply and every output have arrived.
    expect(cell.locator(".jp-InputPrompt")).to_have_text("[1]:", timeout=UI_TIMEOUT_MS)
    stderr = cell.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
    errors = stderr.all_inner_texts()
    assert not errors, "the first code cell wrote to stderr:\n" + "\n".join(errors)


def _screenshot_path(tmp_path: Path) -> Path:
    path = Path(os.environ.get("LABKIT_SCREENSHOT") or tmp_path / "lab.png")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


@pytest.mark.browser
def test_make_lab_runs_the_welcome_notebook_on_the_labkit_kernel(
    page: Page, lab: Lab, root: Path, tmp_path: Path
) -> None:
    specs = _get_json(lab, "/api/kernelspecs")["kernelspecs"]
    assert "labkit" in specs, f"make lab serves the kernels {sorted(specs)}, not labkit"
    assert specs["labkit"]["spec"]["display_name"] == KERNEL
    notebook = root / "notebooks" / NOTEBOOK
    before = notebook.read_bytes()
    try:
        page.goto(lab.url(f"/lab/tree/{NOTEBOOK}"))
        _wait_for_idle_kernel(page)
        _run_first_code_cell(page)
    finally:
        page.screenshot(path=_screenshot_path(tmp_path))
    assert notebook.read_bytes() == before, "the smoke test saved the student's notebook"
