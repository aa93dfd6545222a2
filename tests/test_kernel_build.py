"""The CPU kernels' build can never hang labkit: a build keyed on what it reads, run in a private
directory, under a lock the operating system releases when its holder dies."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from labkit.kernels import cpu as cpu_kernels
from tests.deadline import deadline

ROOT = Path(__file__).resolve().parents[1]
# a tiny extension: the same build path as labkit's kernels, a fraction of the compile time
TINY_CPP = """#include <torch/extension.h>
at::Tensor twice(at::Tensor x) { return x * 2; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice); }
"""


def _python(code: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, text=True,
                            **popen)


def test_the_build_key_covers_every_source_the_flags_and_torch(tmp_path, monkeypatch):
    sources = [cpu_kernels.HERE / s for s in cpu_kernels.SOURCES]
    flags = list(cpu_kernels.CFLAGS)
    key = cpu_kernels.build_key(sources, flags)
    copies = []
    for src in sources:  # the same bytes elsewhere: the same key (no path in it)
        shutil.copy(src, tmp_path / src.name)
        copies.append(tmp_path / src.name)
    assert cpu_kernels.build_key(copies, flags) == key
    for copy in copies:  # one byte more in any file, the header included: a new key
        original = copy.read_bytes()
        copy.write_bytes(original + b" ")
        assert cpu_kernels.build_key(copies, flags) != key, f"{copy.name} is not in the key"
        copy.write_bytes(original)
    assert cpu_kernels.build_key(sources, flags + ["-mavx2"]) != key
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert cpu_kernels.build_key(sources, flags) != key


def test_a_lock_whose_holder_was_killed_blocks_nobody(tmp_path):
    lock = tmp_path / "k.lock"
    holder = _python(f"""
        import time
        from pathlib import Path
        from labkit.kernels.cpu import hold_lock
        with hold_lock(Path({str(lock)!r}), "test"):
            print("held", flush=True)
            time.sleep(600)
        """, stdout=subprocess.PIPE)
    try:
        with deadline(60, "the holder taking the lock"):
            assert holder.stdout.readline().strip() == "held"
        holder.send_signal(signal.SIGKILL)  # as a kernel restart in Lab, or the OOM killer
        holder.wait(10)
        with deadline(5, "taking a lock whose holder is dead"):
            with cpu_kernels.hold_lock(lock, "test"):
                pass
    finally:
        holder.kill()


def test_a_wait_for_a_live_holder_says_what_it_waits_for(tmp_path):
    lock = tmp_path / "k.lock"
    with cpu_kernels.hold_lock(lock, "test"):
        waiter = _python(f"""
            from pathlib import Path
            from labkit.kernels.cpu import hold_lock
            with hold_lock(Path({str(lock)!r}), "another process's build of K", notice_s=0.2):
                print("got it", flush=True)
            """, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            with deadline(60, "the waiter's notice"):
                line = waiter.stderr.readline()
            assert "waiting for another process's build of K" in line and str(lock) in line
            assert waiter.poll() is None, "the waiter did not wait for the lock"
        except BaseException:
            waiter.kill()
            raise
    with deadline(30, "the waiter after the lock was released"):
        out, _ = waiter.communicate()
    assert "got it" in out


@pytest.mark.skipif(shutil.which("ninja") is None or shutil.which("c++") is None,
                    reason="needs a C++ compiler and ninja")
def test_a_build_killed_midway_leaves_nothing_that_blocks_the_next(tmp_path):
    """The first build is SIGKILLed while it compiles; the next process builds and loads
    within a deadline, and a third loads the finished build without compiling."""
    src = tmp_path / "src" / "tiny.cpp"
    src.parent.mkdir()
    src.write_text(TINY_CPP)
    root = tmp_path / "builds"
    code = f"""
        from pathlib import Path
        import torch
        from labkit.kernels.cpu import build_extension
        m = build_extension("tiny", [Path({str(src)!r})], ["-O0"], [], root=Path({str(root)!r}))
        print("twice", m.twice(torch.ones(2)).tolist(), flush=True)
        """
    first = _python(code, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with deadline(120, "the first build starting"):
            while not list(root.glob("tiny_*.build-*")):
                assert first.poll() is None, first.communicate()
                time.sleep(0.05)
        time.sleep(1.0)  # inside the compiler now
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    finally:
        first.kill()
    assert not [p for p in root.iterdir() if p.is_dir() and ".build-" not in p.name], \
        "a killed build left a directory that looks complete"
    for attempt in ("builds", "loads"):
        proc = _python(code, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            with deadline(300, f"the build after a killed one ({attempt})"):
                out, err = proc.communicate()
        finally:
            proc.kill()
        assert proc.returncode == 0 and "twice [2.0, 2.0]" in out, err
        assert ("compiling" in err) == (attempt == "builds"), err
    assert not list(root.glob("tiny_*.build-*")), "the killed build's directory was not cleared"
