"""scripts/time_notebooks.py on tiny synthetic notebooks: the memory it reads, the timeout it
enforces, a failure it records, and the table it writes (docs/instructors.md's timing table)."""

import json
import os

import nbformat
from nbformat.v4 import new_code_cell, new_notebook

from scripts import time_notebooks


def write(path, *sources):
    nb = new_notebook(cells=[new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, path)
    return path


def test_a_run_records_memory_timeout_failure_and_writes_the_table(tmp_path):
    grows = write(tmp_path / "00_grows.ipynb",
                  "import os\nassert os.environ.get('LABKIT_QUICK') == '1'",
                  # 300 MiB written page by page: anonymous, resident, then kept
                  "block = bytearray(300 * 2**20)\nfor i in range(0, len(block), 4096):\n"
                  "    block[i] = 1")
    sleeps = write(tmp_path / "01_sleeps.ipynb", "import time\ntime.sleep(60)")
    raises = write(tmp_path / "02_raises.ipynb", "raise ValueError('the cell broke')")
    records, out = tmp_path / "times.json", tmp_path / "times.md"
    assert time_notebooks.main(["--paths", str(grows), str(sleeps), str(raises),
                                "--timeout", "8", "--records", str(records),
                                "--out", str(out)]) == 0
    got = json.loads(records.read_text())["results"]["quick"]

    ok = got["00_grows"]
    assert ok["status"] == "ok" and ok["wall_s"] < 8
    # the 300 MiB block, on top of an interpreter (tens of MiB): seen by the kernel's own
    # high-water mark and by the sampled tree, in its anonymous part
    assert 300 < ok["kernel_hwm_mib"] < 1000, ok
    assert 300 < ok["tree_anon_mib"] <= ok["tree_rss_mib"], ok
    assert 300 < ok["tree_pss_mib"] <= ok["tree_rss_mib"], ok  # one process: PSS <= RSS
    assert ok["slowest_cell"].startswith("cell ")
    # per cell: the block's cell holds the peak (its high-water mark was reset at its start,
    # so the first cell's peak is the interpreter's alone) and still holds the block at its end
    first, second = ok["cells"]
    assert (first["cell"], second["cell"]) == (0, 1) and ok["peak_cell"] == "cell 1", ok
    assert first["kernel_peak"] < 300 < second["kernel_peak"], ok["cells"]
    assert second["end_anon"] - first["end_anon"] > 290, ok["cells"]  # kept alive: in globals

    stopped = got["01_sleeps"]
    assert stopped["status"] == "timeout" and 8 <= stopped["wall_s"] < 30, stopped
    failed = got["02_raises"]
    assert failed["status"] == "failed" and "the cell broke" in failed["error"], failed

    table = out.read_text()
    assert "| `00_grows` | QUICK |" in table
    assert "over 0 min (stopped)" in table  # 8 s, in whole minutes
    assert "FAILED: " in table and "the cell broke" in table
    run = next(iter(json.loads(records.read_text())["runs"].values()))
    assert run["cores"] >= 1 and run["cpu"] and run["load_start"]
    assert f"**{run['id']}**" in table and run["cpu"] in table


def test_full_mode_runs_without_labkit_quick(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_QUICK", "1")  # set in the shell: --full still unsets it
    full = write(tmp_path / "00_full.ipynb",
                 "import os\nassert os.environ.get('LABKIT_QUICK') is None")
    records = tmp_path / "times.json"
    assert time_notebooks.main(["--full", "--paths", str(full), "--records", str(records),
                                "--out", str(tmp_path / "times.md")]) == 0
    row = json.loads(records.read_text())["results"]["full"]["00_full"]
    assert row["status"] == "ok", row
    assert os.environ["LABKIT_QUICK"] == "1"  # and the caller's is given back


def test_a_full_run_adds_to_the_quick_rows_and_the_hub_column_is_computed():
    records = {"runs": {"r": {"date": "d", "cpu": "c", "cores": 2, "load_start": "0 / 0 / 0",
                              "memory_gib": 8, "python": "3", "command": "x", "notes": ["n"]}},
               "results": {"quick": {}, "full": {}}}
    row = dict(status="ok", wall_s=125.0, timeout_s=600, kernel_hwm_mib=900.0,
               tree_rss_mib=1200.0, tree_pss_mib=1100.0, tree_anon_mib=1000.0,
               slowest_cell="cell 3: 50 s", peak_cell="cell 4", error="", run="r")
    records["results"]["quick"]["05_x"] = {**row, "notebook": "05_x", "mode": "quick"}
    records["results"]["full"]["05_x"] = {**row, "notebook": "05_x", "mode": "full",
                                          "status": "timeout"}
    table = time_notebooks.markdown(records)
    assert ("| `05_x` | QUICK | 2 min 05 s | cell 3: 50 s | 900 (cell 4) | 1,200 | 1,100 | 1,000 "
            "| 14 | r |") in table
    # a row recorded before PSS and the peak's cell were: its columns say n/a, not zero
    old = {k: v for k, v in row.items() if k not in ("tree_pss_mib", "peak_cell")}
    records["results"]["quick"]["06_y"] = {**old, "notebook": "06_y", "mode": "quick"}
    assert "| `06_y` | QUICK | 2 min 05 s | cell 3: 50 s | 900 | 1,200 | n/a | 1,000 |" in (
        time_notebooks.markdown(records))
    assert "| `05_x` | full | over 10 min (stopped) |" in table
    assert time_notebooks.learners_per_hub(1000.0) == "14"  # (16 - 2) GiB / 1000 MiB
