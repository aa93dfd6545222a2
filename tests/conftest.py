"""Shared fixtures: seeded tiny models, the real SmolLM2 (loaded once), CUDA skipping."""

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # so `import exercises` and `from tests import adapters` work
    sys.path.insert(0, str(ROOT))
os.chdir(ROOT)
# one thread: the suite also runs a simulated device process, and 2 threads on 2 shared cores
# slow torch down many times over when anything else runs
torch.set_num_threads(1)
# LABKIT_FAKE_CUDA=1 (make gpu-dry-run): the cuda tests run on the fake CUDA of tests/fake_cuda.py
FAKE_CUDA = os.environ.get("LABKIT_FAKE_CUDA") == "1"
if FAKE_CUDA:
    from tests import fake_cuda

    fake_cuda.install()


def pytest_collection_modifyitems(config, items):
    if FAKE_CUDA:  # a test that measures the GPU itself has nothing to measure on the fake
        skip = pytest.mark.skip(reason="measures the hardware: not on the fake CUDA")
        for item in items:
            if "measures_gpu" in item.keywords:
                item.add_marker(skip)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run scripts/gpu_check.sh on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (model, tokenizer), dequantized once and cached."""
    from labkit.loading import load_model

    return load_model("smollm2-135m")
