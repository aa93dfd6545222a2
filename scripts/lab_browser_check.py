"""What a learner meets in JupyterLab, seen in a real browser (headless Chromium, driven by
Playwright), on a throwaway clone of this repository:

1. the URL `make lab` prints opens the course at notebook 00 (not the Launcher);
2. the exercise check cell grades the file as it is saved now: an untouched stub is "not
   attempted", and after the file is edited and saved (no kernel restart) the same cell grades
   the edit;
3. each clone grades its own `exercises/`: the clone's answer is graded, though the venv's
   editable install points `exercises` at another clone;
4. a timing claim whose first measurement was taken under load is reported inconclusive in the
   cell's output, measured again and decided on the quiet measurement (no AssertionError), and
   a claim a quiet measurement refutes still fails, with a message that says why (a cell the
   check types below the last one: the estimates are given, so the check does not depend on
   what else the machine runs).

Needs Playwright (`pip install playwright`, its Python package only) and a Chromium
(`apt-get install chromium`); neither is a course requirement. Run it with the Python that has
Playwright, pointing at the course's venv:

    /tmp/pw/bin/python scripts/lab_browser_check.py --venv .venv --out results/lab-browser

It prints one line per check and exits 1 if one fails; screenshots land in `--out`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# as the tool library's notes give them for a closed network: no background connections
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ANSWER = '''

def rms_norm(x, weight, eps):  # the learner's answer, saved while the notebook is open
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * weight
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lab(venv: Path, clone: Path, port: int) -> tuple[subprocess.Popen, str]:
    """`make lab PORT=... NO_BROWSER=1` in the clone, with the given venv (no set-up step):
    the Makefile's own recipe, read with `make -n`, run from the clone; (process, its URL)."""
    recipe = subprocess.run(["make", "-s", "-n", "-o", "setup", "lab", f"PORT={port}",
                             "NO_BROWSER=1", f"BIN={venv.resolve() / 'bin'}"], cwd=clone,
                            capture_output=True, text=True, check=True).stdout.strip()
    # JupyterLab renders only the cells in view ("windowing"): turn that off in a settings
    # directory of this run's own, so that every cell is in the page to click
    settings = clone.parent / "lab-settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(clone.parent / "lab-settings")}
    proc = subprocess.Popen(f"exec {recipe}", shell=True, cwd=clone, stderr=subprocess.PIPE,
                            text=True, env=env)
    deadline = time.time() + 120
    url = None
    while time.time() < deadline and url is None:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited ({proc.returncode})")
        m = re.search(rf"(http://127\.0\.0\.1:{port}/\S+)", line)
        if m:
            url = m.group(1)
    if url is None:
        raise RuntimeError("jupyter lab printed no URL within 120 s")
    return proc, url


def run_cell(page, index: int, expect: str, timeout_s: float = 180) -> str:
    """Run cell `index` of the open notebook (click it, Shift+Enter) and wait until its output
    contains `expect`; returns the output text."""
    cell = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell").nth(index)
    cell.scroll_into_view_if_needed()
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")
    out = cell.locator(".jp-OutputArea")
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        text = out.inner_text() if out.count() else ""
        if expect in text:
            return text
        time.sleep(0.5)
    raise AssertionError(f"cell {index}: no {expect!r} in its output after {timeout_s:.0f} s: "
                         f"{text[-400:]!r}")


# typed into a new cell below the notebook's last (no line is indented: pressing Enter after one
# adds no indentation to the next)
CLAIM_CELL = [
    "from labkit import claims",
    "quiet = claims.Estimate((1.00, 1.01, 0.99), busy=0.0)",
    "loaded = claims.Estimate((3.0, 3.1, 2.9), busy=1.4, remeasure=lambda: quiet)",
    "claims.hold(loaded, 0.9, 1.1, 'a ratio first measured under load')",
    "print('held on the quiet measurement')",
    "claims.hold(claims.Estimate((3.0, 3.1, 2.9), busy=0.0), 0.9, 1.1, 'a false claim')",
]


def type_cell(page, index: int, lines: list[str]) -> None:
    """Type `lines` into cell `index` of the open notebook, adding it below the last cell first
    if there is none (Shift+Enter on the last cell has usually added it already)."""
    cells = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell")
    if cells.count() <= index:
        cells.nth(cells.count() - 1).locator(".jp-InputArea-editor").click()
        page.keyboard.press("Escape")
        page.keyboard.press("b")  # command mode: a new cell below
    editor = cells.nth(index).locator(".jp-InputArea-editor")
    editor.scroll_into_view_if_needed()
    editor.click()
    for i, line in enumerate(lines):
        page.keyboard.insert_text(line)  # as pasted: no auto-closed brackets
        if i < len(lines) - 1:
            page.keyboard.press("Enter")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--venv", type=Path, default=ROOT / ".venv", help="the course's venv")
    p.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium",
                   help="the Chromium binary")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "lab-browser",
                   help="where the screenshots go")
    args = p.parse_args(argv)
    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "course"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        lab, url = start_lab(args.venv, clone, free_port())
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=args.chromium,
                                             args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.goto(url)
                # the notebook's own cells (not the placeholder of one while it loads), and its
                # kernel started and idle (the status bar: "Python 3 (ipykernel) | Idle")
                page.wait_for_function("document.querySelectorAll("
                                       "'.jp-NotebookPanel .jp-Notebook .jp-Cell').length > 5",
                                       timeout=120_000)
                page.wait_for_selector(".jp-StatusBar-Widget >> text=/\\| Idle/",
                                       timeout=240_000)
                title = page.locator("#jp-main-dock-panel .lm-TabBar-tab.lm-mod-current")
                tab = title.first.inner_text().strip()
                page.screenshot(path=str(args.out / "1-opened.png"))
                results.append(("the printed URL opens notebook 00", tab == "00_welcome.ipynb",
                                f"the open tab: {tab!r}"))
                cells = page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell")
                n = cells.count()
                run_cell(page, 1, "labkit ")  # the imports (labkit, check)
                before = run_cell(page, n - 1, "not attempted")
                results.append(("an untouched stub is 'not attempted'",
                                "· rms_norm: not attempted" in before, before.splitlines()[0]))
                path = clone / "exercises" / "ch00_welcome.py"
                path.write_text(path.read_text() + ANSWER)  # the learner saves an answer
                after = run_cell(page, n - 1, "✓ rms_norm")
                page.screenshot(path=str(args.out / "2-graded-after-edit.png"))
                results.append(("the check cell grades the saved edit, no restart",
                                "✓ rms_norm" in after, after.splitlines()[0]))
                results.append(("this clone's exercises/ were graded, not the venv's",
                                "✓ rms_norm" in after and ROOT != clone, str(clone)))
                type_cell(page, n, CLAIM_CELL)
                claim = run_cell(page, n, "a false claim", timeout_s=60)
                page.screenshot(path=str(args.out / "3-claim-under-load.png"), full_page=True)
                results.append((
                    "a claim measured under load is reported inconclusive, then decided quiet",
                    "inconclusive under load" in claim and "held on the quiet measurement" in claim,
                    next((ln for ln in claim.splitlines() if "inconclusive" in ln), "")[:160]))
                results.append(("a claim a quiet measurement refutes still fails",
                                "AssertionError" in claim,
                                next((ln for ln in claim.splitlines()
                                      if ln.startswith("AssertionError:")), "")[:160]))
                browser.close()
        finally:
            lab.terminate()
            lab.wait(30)
    for what, ok, detail in results:
        print(f"{'✓' if ok else '✗'} {what}: {detail}")
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
