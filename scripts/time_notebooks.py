"""Time every notebook of the course and measure the memory its kernel takes: the table of
docs/notebook_times.md, which docs/instructors.md reads from. Regenerate it; never type it.

    .venv/bin/python scripts/time_notebooks.py                    # QUICK mode, all nine
    .venv/bin/python scripts/time_notebooks.py --full --timeout 600 --notebooks 00 01
    .venv/bin/python scripts/time_notebooks.py --notebooks 05_paged_attention

Each notebook runs top to bottom in a fresh Jupyter kernel (nbclient, the engine under
`jupyter nbconvert --execute` and nbval), with `LABKIT_QUICK=1` unless `--full`, its working
directory `notebooks/`, as a learner's "Run All" would. Recorded per notebook:

- the wall seconds from the kernel's start to the last cell's end, and the slowest cell;
- the kernel process's peak resident memory (`VmHWM` in /proc/<pid>/status, Linux's own
  high-water mark), and the cell that reached it: the mark is reset at each cell's start
  (`clear_refs`), so each cell's own peak is exact too;
- the peak of its whole process tree, sampled every 0.2 s (the kernel plus what it starts: the
  simulated accelerator of chapters 06-07, the server of chapter 08, a kernel build): the
  resident total, its proportional set size (PSS) and the anonymous part alone. The resident
  total counts a page once per process that maps it (torch's libraries in every process, the
  weights the simulated accelerator shares with the kernel twice); PSS counts each page once,
  split among the processes that map it: what the tree occupies. Anonymous memory (tensors,
  Python objects) is what each learner costs a shared machine; the rest of the resident total
  is mostly file pages (torch's libraries, the cached weights read from disk), which learners
  sharing one venv and one cache share in the page cache. A sample can miss a peak shorter than
  its period; the kernel's own high-water mark cannot;
- per cell (`--cells` prints them; the JSON keeps them): its seconds, its peaks, and what the
  kernel still holds when it ends (resident, anonymous, file-backed), which shows the objects
  a notebook keeps alive and the cell that made them.

A notebook that runs past `--timeout` seconds is stopped (its kernel and the processes it
started are killed) and recorded as "over N min (stopped)"; one that raises is recorded as
failed, with the error's first line. Results are kept per mode in docs/notebook_times.json, so
that a `--full` run of some notebooks adds to the QUICK run of all nine instead of replacing it;
each row names the run that measured it, and each run its machine (CPU model, cores, load
average at its start), date and command. The markdown is written from that file.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
DOCS = ROOT / "docs"
MiB = 2**20
GiB = 2**30
SAMPLE_S = 0.2  # the period of the process-tree sampler
HUB_GIB = 16  # the shared machine the guide sizes: how many learners fit in 16 GB
HUB_RESERVE_GIB = 2  # left to the OS, JupyterHub and the page cache of the shared files


@dataclass
class Result:
    """One notebook's run: how long, how it ended, and the memory it took (MiB)."""

    notebook: str
    mode: str  # "quick" or "full"
    status: str  # "ok", "timeout" or "failed"
    wall_s: float
    timeout_s: float
    kernel_hwm_mib: float | None = None  # the kernel's own VmHWM
    tree_rss_mib: float | None = None  # sampled peak of the tree's resident total
    tree_anon_mib: float | None = None  # sampled peak of the tree's anonymous memory
    tree_pss_mib: float | None = None  # sampled peak of the tree's proportional set size
    slowest_cell: str = ""  # "cell 13: 41 s"
    peak_cell: str = ""  # the cell where the kernel's resident memory peaked: "cell 12"
    error: str = ""
    run: str = ""
    cells: list[dict] = field(default_factory=list)  # per code cell: see MemorySampler.end_cell


# --------------------------------------------------------------------------------------------
# memory: /proc on Linux; elsewhere the columns stay empty
# --------------------------------------------------------------------------------------------


def proc_status(pid: int) -> dict[str, int]:
    """The kB fields of /proc/<pid>/status (VmHWM, VmRSS, RssAnon, ...), in bytes; {} if gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key] = int(parts[0]) * 1024
    return out


def proc_pss(pid: int) -> int:
    """The process's proportional set size in bytes (/proc/<pid>/smaps_rollup): each page it
    maps counted once, divided among the processes that map it; 0 if gone or unreadable."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (Linux: /proc/<pid>/task/*/children)."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        seen.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo.extend(int(c) for c in task.read_text().split())
            except (OSError, ValueError):
                pass
    return seen


class MemorySampler:
    """Samples a process tree's memory in a thread: the peaks of its resident and anonymous
    totals, and the root's own high-water mark (VmHWM), which the kernel keeps exactly.

    Per cell (start_cell / end_cell around each one): the root's high-water mark is reset at
    the cell's start (Linux: "5" written to /proc/<pid>/clear_refs), so its VmHWM at the cell's
    end is that cell's exact peak; with it, the tree's sampled peaks during the cell and what
    the root still holds when the cell ends (resident, anonymous, file-backed): a cell whose
    end is far above the previous one's keeps objects alive in the notebook's globals."""

    def __init__(self, pid: int, period_s: float = SAMPLE_S):
        self.pid, self.period_s = pid, period_s
        self.hwm = self.rss = self.anon = self.pss = 0
        self.cells: list[dict] = []
        self._cell: dict | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        """One reading of the tree: update the peaks (the notebook's and the cell's)."""
        rss = anon = pss = 0
        for p in process_tree(self.pid):
            st = proc_status(p)
            if p == self.pid and "VmHWM" in st:
                self.hwm = max(self.hwm, st["VmHWM"])
            rss += st.get("VmRSS", 0)
            anon += st.get("RssAnon", 0)
            pss += proc_pss(p)
        with self._lock:
            self.rss, self.anon = max(self.rss, rss), max(self.anon, anon)
            self.pss = max(self.pss, pss)
            if self._cell is not None:
                for key, value in (("tree_rss", rss), ("tree_anon", anon), ("tree_pss", pss)):
                    self._cell[key] = max(self._cell[key], value)

    def start_cell(self, index: int) -> None:
        """A cell starts: reset the root's high-water mark, so that the cell's is exact."""
        self.sample()  # the peak so far is kept in self.hwm before the reset
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
        except OSError:  # not Linux, or not allowed: the cell's peak is then the run's so far
            pass
        with self._lock:
            self._cell = {"cell": index, "t0": time.perf_counter(), "tree_rss": 0,
                          "tree_anon": 0, "tree_pss": 0}

    def end_cell(self) -> None:
        """A cell ended: record its seconds, its peaks and what the kernel holds now (MiB)."""
        self.sample()
        st = proc_status(self.pid)
        with self._lock:
            cell, self._cell = self._cell, None
        if cell is None:
            return
        self.cells.append({
            "cell": cell["cell"], "s": round(time.perf_counter() - cell["t0"], 1),
            "kernel_peak": self.mib(st.get("VmHWM", 0)),  # exact: reset at the cell's start
            "tree_rss": self.mib(cell["tree_rss"]), "tree_anon": self.mib(cell["tree_anon"]),
            "tree_pss": self.mib(cell["tree_pss"]),
            "end_rss": self.mib(st.get("VmRSS", 0)), "end_anon": self.mib(st.get("RssAnon", 0)),
            "end_file": self.mib(st.get("RssFile", 0))})

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period_s)

    def mib(self, value: int) -> float | None:
        return round(value / MiB, 1) if value else None


def kill_tree(pid: int) -> None:
    """Kill a kernel and every process it started (a notebook past its timeout)."""
    import signal

    for p in reversed(process_tree(pid)):  # children first, so none is re-parented and missed
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


# --------------------------------------------------------------------------------------------
# one notebook
# --------------------------------------------------------------------------------------------


def slowest_cell(nb) -> str:
    """The code cell that took longest, from nbclient's timing metadata: "cell 13: 41 s"."""
    best = None
    for i, cell in enumerate(nb.cells):
        meta = cell.get("metadata", {}).get("execution", {})
        t0, t1 = meta.get("iopub.execute_input"), meta.get("shell.execute_reply")
        if cell.cell_type != "code" or not (t0 and t1):
            continue
        took = (dt.datetime.fromisoformat(t1.replace("Z", "+00:00"))
                - dt.datetime.fromisoformat(t0.replace("Z", "+00:00"))).total_seconds()
        if best is None or took > best[1]:
            best = (i, took)
    return f"cell {best[0]}: {best[1]:.0f} s" if best else ""


def run_notebook(path: Path, mode: str, timeout_s: float, out_dir: Path | None = None,
                 kernel: str = "python3") -> Result:
    """Execute one notebook in a fresh kernel; time it and sample its memory."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    env_quick = os.environ.get("LABKIT_QUICK")
    if mode == "quick":
        os.environ["LABKIT_QUICK"] = "1"  # the kernel inherits this process's environment
    else:
        os.environ.pop("LABKIT_QUICK", None)
    # per cell no limit of its own: the watchdog below holds the whole notebook to timeout_s
    client = NotebookClient(nb, timeout=None, kernel_name=kernel, allow_errors=False,
                            resources={"metadata": {"path": str(path.parent)}})
    result = Result(path.stem, mode, "ok", 0.0, timeout_s)
    stopped = threading.Event()
    t0 = time.perf_counter()
    sampler = None
    try:
        with client.setup_kernel():
            pid = client.km.provisioner.process.pid
            sampler = MemorySampler(pid)

            def stop() -> None:
                stopped.set()
                kill_tree(pid)

            watchdog = threading.Timer(max(0.0, timeout_s - (time.perf_counter() - t0)), stop)
            watchdog.daemon = True
            with sampler:
                watchdog.start()
                try:
                    for index, cell in enumerate(nb.cells):
                        if cell.cell_type != "code":
                            continue
                        sampler.start_cell(index)
                        try:
                            client.execute_cell(cell, index)
                        finally:
                            sampler.end_cell()
                finally:
                    watchdog.cancel()
                    sampler.sample()  # a last reading before the kernel shuts down
    except Exception as err:  # a cell raised, or the kernel died (killed at the timeout)
        if stopped.is_set():
            result.status = "timeout"
        else:
            result.status = "failed"
            lines = [ln for ln in str(err).splitlines() if ln.strip()]
            result.error = (lines[-1] if lines else type(err).__name__)[:200]
    finally:
        result.wall_s = round(time.perf_counter() - t0, 1)
        if env_quick is None:
            os.environ.pop("LABKIT_QUICK", None)
        else:
            os.environ["LABKIT_QUICK"] = env_quick
    if sampler is not None:
        result.kernel_hwm_mib = sampler.mib(sampler.hwm)
        result.tree_rss_mib = sampler.mib(sampler.rss)
        result.tree_anon_mib = sampler.mib(sampler.anon)
        result.tree_pss_mib = sampler.mib(sampler.pss)
        result.cells = sampler.cells
        peaks = [c for c in sampler.cells if c["kernel_peak"]]
        if peaks:
            top = max(peaks, key=lambda c: c["kernel_peak"])
            result.peak_cell = f"cell {top['cell']}"
    result.slowest_cell = slowest_cell(nb)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out_dir / path.name)
    return result


# --------------------------------------------------------------------------------------------
# the machine, the records, the table
# --------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One invocation of this script: when, where, how."""

    id: str
    date: str
    cpu: str
    cores: int
    load_start: str
    memory_gib: float | None
    python: str
    command: str
    notes: list[str] = field(default_factory=list)


def machine(run_id: str, command: str) -> Run:
    """This machine as a run sees it at its start."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    total = proc_meminfo_total()
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return Run(run_id, dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"), cpu,
               os.cpu_count() or 0, " / ".join(f"{x:.2f}" for x in load),
               round(total / GiB, 1) if total else None, platform.python_version(), command)


def proc_meminfo_total() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def load_records(path: Path) -> dict:
    if path.is_file():
        return json.loads(path.read_text())
    return {"runs": {}, "results": {"quick": {}, "full": {}}}


def fmt_wall(r: dict) -> str:
    if r["status"] == "timeout":
        return f"over {r['timeout_s'] / 60:.0f} min (stopped)"
    s = r["wall_s"]
    text = f"{s:.0f} s" if s < 90 else f"{int(s // 60)} min {int(s % 60):02d} s"
    return text if r["status"] == "ok" else f"{text}, FAILED: {r['error']}"


def fmt_mib(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def fmt_peak(r: dict) -> str:
    """The kernel's peak, and the cell it was reached in when known: "1,288 (cell 12)"."""
    at = r.get("peak_cell")
    return fmt_mib(r["kernel_hwm_mib"]) + (f" ({at})" if at else "")


def cell_table(r: dict) -> str:
    """One notebook's memory, cell by cell (MiB): the `--cells` printout."""
    out = [f"  {'cell':>4} {'s':>6} {'peak':>7} {'tree':>7} {'tree pss':>8} {'tree anon':>9} "
           f"{'end rss':>8} {'end anon':>8} {'end file':>8}"]
    for c in r.get("cells", []):
        out.append(f"  {c['cell']:>4} {c['s']:>6.1f} {fmt_mib(c['kernel_peak']):>7} "
                   f"{fmt_mib(c['tree_rss']):>7} {fmt_mib(c.get('tree_pss')):>8} "
                   f"{fmt_mib(c['tree_anon']):>9} "
                   f"{fmt_mib(c['end_rss']):>8} {fmt_mib(c['end_anon']):>8} "
                   f"{fmt_mib(c['end_file']):>8}")
    return "\n".join(out)


def learners_per_hub(anon_mib: float | None) -> str:
    """How many kernels at this peak fit in a 16 GB machine, a reserve kept back."""
    if not anon_mib:
        return "n/a"
    return str(int((HUB_GIB - HUB_RESERVE_GIB) * 1024 // anon_mib))


def markdown(records: dict) -> str:
    """docs/notebook_times.md, from the records."""
    out = ["# Notebook times and memory, measured",
           "",
           "Written by `scripts/time_notebooks.py` from `docs/notebook_times.json`; do not edit "
           "by hand: run the script again (`--full` for full mode, `--notebooks 03 05` for some).",
           "",
           "Each notebook ran top to bottom in a fresh kernel (its working directory "
           "`notebooks/`), in QUICK mode (`LABKIT_QUICK=1`, what `make test` and `make book` run) "
           "or in full mode (what a learner gets by default). *Wall*: the kernel's start to the "
           "last cell's end. *Kernel peak*: the kernel process's high-water mark (VmHWM), "
           "and the cell that reached it (the script resets the mark at each cell's start; "
           "`--cells` prints every cell's peak and what the kernel still holds at its end, "
           "and the JSON keeps them). *Tree "
           "peak*: the kernel and the processes it started (the simulated accelerator of 06-07, "
           "the ablation's devices and the server of 08), sampled every "
           f"{SAMPLE_S} s: the sum of their resident memory, which counts a page once per "
           "process that maps it; *PSS*: each page counted once, split among the processes "
           "that map it (what the tree occupies); *anon*: its anonymous part, what each "
           "learner adds to a shared "
           "machine (file pages of the shared venv and cache are shared). *Per 16 GB*: how many "
           f"kernels at that anonymous peak fit in {HUB_GIB} GB with {HUB_RESERVE_GIB} GB kept "
           "back, if every learner were at this notebook's peak at once (the worst case). "
           "Memory is in MiB. A stopped or failed row's memory and slowest cell cover only what "
           "ran before it stopped.",
           "",
           "| notebook | mode | wall | slowest cell | kernel peak | tree peak | tree peak, PSS "
           "| tree peak, anon | per 16 GB | run |",
           "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    names = sorted({n for mode in records["results"].values() for n in mode})
    for name in names:
        for mode in ("quick", "full"):
            r = records["results"].get(mode, {}).get(name)
            if r is None:
                continue
            out.append(f"| `{name}` | {'QUICK' if mode == 'quick' else 'full'} | {fmt_wall(r)} "
                       f"| {r['slowest_cell'] or '-'} | {fmt_peak(r)} "
                       f"| {fmt_mib(r['tree_rss_mib'])} | {fmt_mib(r.get('tree_pss_mib'))} "
                       f"| {fmt_mib(r['tree_anon_mib'])} "
                       f"| {learners_per_hub(r['tree_anon_mib'])} | {r['run']} |")
    for mode in ("quick", "full"):
        done = [r for r in records["results"].get(mode, {}).values() if r["status"] == "ok"]
        if done:
            total = sum(r["wall_s"] for r in done)
            out += ["", f"{'QUICK' if mode == 'quick' else 'Full'} mode, the {len(done)} "
                        f"notebooks that ran to the end: {total / 60:.1f} min in all."]
    out += ["", "## Runs", ""]
    used = {r["run"] for mode in records["results"].values() for r in mode.values()}
    for run in sorted(used):
        m = records["runs"][run]
        mem = f", {m['memory_gib']} GiB of memory" if m.get("memory_gib") else ""
        out.append(f"- **{run}**: {m['date']}; {m['cpu']}, {m['cores']} cores{mem}; load "
                   f"average at the start {m['load_start']} (1 / 5 / 15 min); Python "
                   f"{m['python']}; `{m['command']}`")
        out += [f"  {note}" for note in m.get("notes", [])]
    return "\n".join(out) + "\n"


def select(names: list[str] | None) -> list[Path]:
    """The notebooks to run: all, or those whose file name starts with one of `names`."""
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if not names:
        return paths
    chosen = [p for p in paths if any(p.stem.startswith(n) for n in names)]
    missing = [n for n in names if not any(p.stem.startswith(n) for p in paths)]
    if missing:
        raise SystemExit(f"no notebook matches {missing}; known: {[p.stem for p in paths]}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true",
                   help="full mode (LABKIT_QUICK unset); default: QUICK mode")
    p.add_argument("--notebooks", nargs="*", metavar="NAME",
                   help="only these (a prefix of the file name: 03 or 03_quantization)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds one notebook may run before it is stopped (default 900)")
    p.add_argument("--paths", nargs="*", type=Path, metavar="IPYNB",
                   help="notebooks outside notebooks/ (the tests use it)")
    p.add_argument("--records", type=Path, default=DOCS / "notebook_times.json")
    p.add_argument("--out", type=Path, default=DOCS / "notebook_times.md")
    p.add_argument("--executed", type=Path, default=None,
                   help="also write the executed notebooks here")
    p.add_argument("--cells", action="store_true",
                   help="print each notebook's memory cell by cell (peak, and held at its end)")
    p.add_argument("--note", action="append", default=[],
                   help="a line to record with this run (e.g. what else ran on the machine)")
    args = p.parse_args(argv)
    paths = args.paths or select(args.notebooks)
    mode = "full" if args.full else "quick"
    records = load_records(args.records)
    run_id = f"{mode}-{dt.datetime.now().strftime('%Y%m%d-%H%M')}"
    given = list(sys.argv[1:] if argv is None else argv)
    for i in range(len(given) - 2, -1, -1):  # the notes are listed apart, not in the command
        if given[i] == "--note":
            del given[i:i + 2]
    command = " ".join(["scripts/time_notebooks.py", *map(shlex.quote, given)])
    run = machine(run_id, command)
    run.notes = list(args.note)
    records["runs"][run_id] = asdict(run)
    print(f"{run_id}: {run.cpu}, {run.cores} cores, load {run.load_start}", flush=True)
    for path in paths:
        r = run_notebook(path, mode, args.timeout, args.executed)
        r.run = run_id
        records["results"].setdefault(mode, {})[r.notebook] = asdict(r)
        print(f"{r.notebook:<24} {mode:<5} {fmt_wall(asdict(r)):<28} kernel "
              f"{fmt_mib(r.kernel_hwm_mib)} MiB, tree {fmt_mib(r.tree_rss_mib)} MiB "
              f"(PSS {fmt_mib(r.tree_pss_mib)}, anon {fmt_mib(r.tree_anon_mib)}); slowest "
              f"{r.slowest_cell}; peak {r.peak_cell}", flush=True)
        if args.cells:
            print(cell_table(asdict(r)), flush=True)
        # written after every notebook: a run stopped halfway keeps what it measured
        args.records.parent.mkdir(parents=True, exist_ok=True)
        args.records.write_text(json.dumps(records, indent=1) + "\n")
        args.out.write_text(markdown(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
