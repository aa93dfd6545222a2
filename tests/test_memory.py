"""labkit.utils.memory: freed tensors' heap pages go back to the system on `release`."""

import re
from pathlib import Path

import pytest
import torch

from labkit.utils import memory


def anon_mib() -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"RssAnon:\s+(\d+)", status).group(1)) / 1024


def test_release_gives_the_heap_pages_of_freed_tensors_back():
    if not Path("/proc/self/status").is_file() or not memory.trim():
        pytest.skip("glibc on Linux only: elsewhere release() only collects garbage")
    big = torch.ones(4 * 2**20)
    del big  # 16 MiB freed: glibc's mmap threshold rises to it
    blocks = [torch.ones(2**18) for _ in range(300)]  # 1 MiB each, now from the heap
    before = anon_mib()
    del blocks[:-1]  # the last one stays: the heap cannot shrink from its top
    assert anon_mib() > before - 100, "freed heap blocks were returned without a trim"
    assert memory.release()
    assert anon_mib() < before - 200, f"release() returned {before - anon_mib():.0f} MiB of 299"
