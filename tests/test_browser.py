"""Browser smoke tests: `make lab` serves the notebooks on the labkit kernel, and they run.

The tests share one real `make lab` (which adds --allow-root itself when run as root): LAB_ARGS
only pin a loopback port and a random token, keep JupyterLab off the network, and keep its
settings, layout and checkpoints in a temporary directory. A notebook is opened in Debian's
chromium, and the test waits until it shows "Python (labkit)" and the kernel is idle.

- The welcome test checks over REST that the `labkit` kernelspec is served, opens
  notebooks/00_welcome.ipynb (the one `make lab` opens), runs the first code cell with
  Shift+Enter and checks that it finished with no stderr output (JupyterLab 4 renders a
  traceback as stderr too).
- The slider test opens notebooks/02_kv_memory.ipynb (the student copy, exercises still stubs),
  runs all cells from the Run menu, checks that no cell wrote to stderr, moves the "context"
  slider of the Explore widgets two steps right (8K -> 16K -> 32K tokens) and checks that the KV
  cache figure shown doubles at each step.

Each saves a screenshot (LABKIT_SCREENSHOT=path/lab.png keeps the welcome one as that file and
the others beside it as path/lab-<notebook>.png). Autosave is off for the run, so the notebook
files are left exactly as they were.

Needs `chromium` on PATH (Debian: apt-get install chromium; never `playwright install`).
Without it the test skips, unless CI is set: then it fails.
"""
from __future__ import annotations

import json
import os
import re
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
KV_NOTEBOOK = "02_kv_memory.ipynb"
KERNEL = "Python (labkit)"
SERVER_START_S = 60
UI_TIMEOUT_MS = 60_000
# A whole notebook takes 60-100 s on 2 CPU cores, more when the machine is busy.
RUN_ALL_TIMEOUT_MS = 300_000
# JupyterLab 4 renders stderr, and a traceback too, with this mime type.
STDERR = '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'
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


@pytest.fixture(scope="module")
def lab(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """The real `make lab` on a free loopback port, killed with its whole process group: one for the
    tests of this file, each on a notebook of its own (so a kernel of its own)."""
    tmp_path = tmp_path_factory.mktemp("lab")
    if subprocess.run(["make", "-q", "install"], cwd=root).returncode != 0:
        pytest.fail("the install is missing or older than pyproject.toml: run `make install` first")
    port, token = _free_port(), secrets.token_hex(16)
    log = tmp_path / "make-lab.log"
    command = ["make", "lab", "LAB_ARGS=" + shlex.join(_lab_args(port, token, tmp_path))]
    # The student copies run with their exercises still stubs: their checks print, and would
    # raise under a LABKIT_STRICT=1 left in the caller's environment.
    env = {**os.environ, "LABKIT_STRICT": "0"}
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        lab = Lab(f"http://127.0.0.1:{port}", token)
        _wait_for_server(lab, proc, log)
        yield lab
    finally:
        _stop(proc)


def _workspace_url(notebook: str) -> str:
    """The notebook alone in a workspace of its own: the tests share a server, whose default workspace
    would reopen the notebooks of the tests before."""
    return f"/lab/workspaces/{Path(notebook).stem}/tree/{notebook}"


def _wait_for_idle_kernel(page: Page, notebook: str) -> None:
    expect(page.locator(".jp-NotebookPanel")).to_have_count(1, timeout=UI_TIMEOUT_MS)
    tab = page.locator("#jp-main-dock-panel .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel")
    expect(tab).to_have_text(notebook, timeout=UI_TIMEOUT_MS)
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
    errors = cell.locator(STDERR).all_inner_texts()
    assert not errors, "the first code cell wrote to stderr:\n" + "\n".join(errors)


def _stderr_outputs(page: Page) -> list[str]:
    """The text of every stderr output in the notebook (tracebacks included)."""
    # textContent, not innerText: cells scrolled out of view skip layout (content-visibility).
    return page.locator(f".jp-NotebookPanel {STDERR}").all_text_contents()


def _run_all_cells(page: Page) -> None:
    """Run > Run All Cells, then wait until the last code cell has run (or something failed)."""
    page.locator("#jp-menu-panel .lm-MenuBar-itemLabel").get_by_text("Run", exact=True).click()
    page.locator(".lm-Menu .lm-Menu-itemLabel").get_by_text("Run All Cells", exact=True).click()
    # Every code cell shows "[*]:" once queued and "[n]:" once it has run. An error stops the
    # run and shows as stderr, so stop waiting on the first stderr output too.
    last_prompt = page.locator(".jp-NotebookPanel .jp-CodeCell").last.locator(".jp-InputPrompt")
    done = last_prompt.filter(has_text=re.compile(r"^\[\d+\]:$"))
    stderr = page.locator(f".jp-NotebookPanel {STDERR}")
    expect(done.or_(stderr).first).to_be_attached(timeout=RUN_ALL_TIMEOUT_MS)
    errors = _stderr_outputs(page)
    assert not errors, "a cell wrote to stderr:\n" + "\n".join(errors)
    expect(last_prompt).to_have_text(re.compile(r"^\[\d+\]:$"))


def _gib(text: str) -> float:
    """The KV cache's size as shown ("3.2 GiB", "1,234 GiB", or "512 MiB" where it is small), in GiB."""
    match = re.fullmatch(r"(\d{1,3}(?:,\d{3})*(?:\.\d+)?) (GiB|MiB)", text.strip())
    assert match, f"the KV cache figure reads {text!r}, not 'X GiB' or 'X MiB' (bench.format_bytes)"
    return float(match[1].replace(",", "")) / (1024 if match[2] == "MiB" else 1)


def _move_context_slider(page: Page) -> None:
    """Two steps right on the "context" slider; the KV cache shown doubles at each."""
    explore = page.locator(".jp-NotebookPanel .jp-CodeCell").last.locator(".jp-OutputArea")
    # `has` is matched inside each .widget-slider, so it starts from the page, not `explore`.
    label = page.locator(".widget-label").get_by_text("context", exact=True)
    slider = explore.locator(".widget-slider").filter(has=label)
    expect(slider).to_have_count(1, timeout=UI_TIMEOUT_MS)
    readout, handle = slider.locator(".widget-readout"), slider.locator(".noUi-handle")
    kv_cache = explore.locator("#kv-cache-size")
    expect(readout).to_have_text("8K")
    expect(kv_cache).to_have_text(re.compile(r"^[\d,.]+ GiB$"), timeout=UI_TIMEOUT_MS)
    # Both plotly FigureWidgets (the memory bar and the curves) have drawn.
    expect(explore.locator(".js-plotly-plot")).to_have_count(2, timeout=UI_TIMEOUT_MS)
    # every visible curve is named in the legend (plotly shows "trace N" for a name lost on the way)
    expect(explore.locator(".legendtext").get_by_text("room beside the weights")).to_have_count(1)
    expect(explore.locator(".legendtext").get_by_text(re.compile(r"^trace \d+$"))).to_have_count(0)
    handle.scroll_into_view_if_needed()
    for context in ("16K", "32K"):
        before = kv_cache.text_content() or ""
        # continuous_update=False: the kernel hears of the new value on release, which for the
        # keyboard is the key press itself; then update() rewrites the summary.
        handle.press("ArrowRight")
        expect(readout).to_have_text(context)
        expect(kv_cache).not_to_have_text(before, timeout=UI_TIMEOUT_MS)
        after = kv_cache.text_content() or ""
        assert _gib(after) == pytest.approx(2 * _gib(before), rel=0.01), (
            f"KV cache went from {before} to {after} when the context doubled to {context}"
        )
    # The whole UI in view for the screenshot: controls, summary, bar and curves.
    explore.evaluate("area => area.scrollIntoView({block: 'start'})")


def _screenshot_path(tmp_path: Path, notebook: str) -> Path:
    """LABKIT_SCREENSHOT (or lab.png) for the welcome notebook, with `-<notebook>` for others."""
    path = Path(os.environ.get("LABKIT_SCREENSHOT") or tmp_path / "lab.png")
    if notebook != NOTEBOOK:
        path = path.with_name(f"{path.stem}-{Path(notebook).stem}{path.suffix or '.png'}")
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
        page.goto(lab.url(_workspace_url(NOTEBOOK)))
        _wait_for_idle_kernel(page, NOTEBOOK)
        _run_first_code_cell(page)
    finally:
        page.screenshot(path=_screenshot_path(tmp_path, NOTEBOOK))
    assert notebook.read_bytes() == before, "the smoke test saved the student's notebook"


@pytest.mark.browser
def test_kv_memory_notebook_runs_and_its_context_slider_moves_the_kv_cache_figure(
    page: Page, lab: Lab, root: Path, tmp_path: Path
) -> None:
    notebook = root / "notebooks" / KV_NOTEBOOK
    before = notebook.read_bytes()
    # Tall enough for the whole Explore UI (controls, summary, both figures) in the screenshot.
    page.set_viewport_size({"width": 1280, "height": 1200})
    try:
        page.goto(lab.url(_workspace_url(KV_NOTEBOOK)))
        _wait_for_idle_kernel(page, KV_NOTEBOOK)
        _run_all_cells(page)
        _wait_for_idle_kernel(page, KV_NOTEBOOK)
        _move_context_slider(page)
        _wait_for_idle_kernel(page, KV_NOTEBOOK)
    finally:
        page.screenshot(path=_screenshot_path(tmp_path, KV_NOTEBOOK))
    assert notebook.read_bytes() == before, "the browser test saved the student's notebook"
