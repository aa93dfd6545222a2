"""`make lab`: what it runs, read with `make -n` (nothing starts)."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def lab_command(*settings: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("no make")
    proc = subprocess.run(["make", "-n", "lab", *settings], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return " ".join(proc.stdout.replace("\\\n", " ").split())


def test_the_printed_url_opens_notebook_00_not_the_launcher():
    # Jupyter prints its default URL: pointed at the notebook, it is what the learner opens
    cmd = lab_command()
    assert "--LabApp.default_url=/lab/tree/notebooks/00_welcome.ipynb" in cmd, cmd
    assert (ROOT / "notebooks" / "00_welcome.ipynb").is_file()
    assert "--no-browser" not in cmd and "--port" not in cmd


def test_a_remote_machine_picks_the_port_and_no_browser():
    cmd = lab_command("PORT=8890", "NO_BROWSER=1")
    assert "--port=8890" in cmd and "--no-browser" in cmd, cmd
    readme = (ROOT / "README.md").read_text()
    assert "make lab PORT=" in " ".join(readme.split()) and "NO_BROWSER=1" in readme
