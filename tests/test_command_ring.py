"""The simulated device's command queue (`labkit.device.CommandRing`): commands come out whole
and in order across the ring's wrap, a full ring waits for the device instead of overwriting
it, and a device whose host died without closing it exits by itself."""

import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
import time

import pytest

from labkit.device import CommandRing
from tests.deadline import deadline

CTX = mp.get_context("spawn")


def drain(ring: CommandRing) -> list[bytes]:
    out = []
    while ring.doorbell.acquire(block=False):
        out.append(ring.take()[0])
    return out


def never(since: float) -> None:
    raise AssertionError("the ring had room: nobody should have waited")


def test_commands_come_out_whole_and_in_order_across_the_wrap():
    ring = CommandRing(CTX, capacity=128)
    sent, got = [], []
    for i in range(60):  # lengths 0..12 bytes: every offset, and many wraps of 128 bytes
        data = bytes([i]) * (i % 13)
        ring.put(data, never)
        sent.append(data)
        if i % 2 == 1:  # the device takes them in pairs, as it does a step at a time
            got += drain(ring)
    got += drain(ring)
    assert got == sent
    assert int(ring.pos[0]) == int(ring.pos[1]) > 3 * 128  # it wrapped, and nothing is left


def test_a_full_ring_waits_for_the_device_and_overwrites_nothing():
    ring = CommandRing(CTX, capacity=64)
    ring.put(b"a" * 16, never)  # 32 bytes with its head
    ring.put(b"b" * 16, never)  # 64: full
    waits = []

    def device_takes_one(since):  # what the host sees while it waits: the device takes one
        waits.append(since)
        assert ring.doorbell.acquire(block=False)
        assert ring.take()[0] == b"a" * 16

    ring.put(b"c" * 12, device_takes_one)
    assert len(waits) == 1  # one wait, then room
    assert drain(ring) == [b"b" * 16, b"c" * 12]


def test_a_command_larger_than_the_ring_is_refused_with_its_size():
    ring = CommandRing(CTX, capacity=64)
    with pytest.raises(ValueError, match="100-byte command does not fit the device's 64-byte"):
        ring.put(b"x" * 100, never)
    ring.put(b"ok", never)  # nothing was written: the ring still works
    assert drain(ring) == [b"ok"]


@pytest.mark.skipif(not hasattr(os, "getppid") or sys.platform == "win32",
                    reason="the orphan check reads the parent's pid (POSIX)")
def test_a_device_whose_host_died_without_closing_it_exits():
    """No pipe closes when the host dies, so the idle device checks that its parent is alive."""
    script = textwrap.dedent("""
        import os
        from labkit.engine import Engine
        from labkit.model import LlamaModel, ModelConfig, init_random
        if __name__ == "__main__":
            model = init_random(LlamaModel(ModelConfig.tiny()).eval(), seed=1)
            e = Engine(model, None, device="process", kv_tokens=64, block_size=8, max_seqs=1)
            print(e.device.proc.pid, flush=True)
            os._exit(0)  # no close, no atexit: the device is left behind
    """)
    with deadline(60):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.dirname(__file__)), timeout=60)
        assert out.returncode == 0, out.stderr
        pid = int(out.stdout.split()[-1])
        gone_by = time.monotonic() + 10
        while time.monotonic() < gone_by:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        os.kill(pid, 9)
        pytest.fail(f"the orphaned device process {pid} was still running 10 s after its host "
                    "died")
