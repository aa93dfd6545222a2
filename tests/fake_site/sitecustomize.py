"""Installs the fake CUDA (tests/fake_cuda.py) in every Python that starts with this folder on
PYTHONPATH and LABKIT_FAKE_CUDA=1: how `make gpu-dry-run` runs scripts/gpu_check.sh on a CPU."""

import os
import sys
from pathlib import Path

if os.environ.get("LABKIT_FAKE_CUDA") == "1":
    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.insert(0, root)
    import torch

    from tests.fake_cuda import install

    torch.set_num_threads(1)  # as tests/conftest.py: the "device" is this CPU, shared
    install()
