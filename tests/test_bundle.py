"""The offline classroom (scripts/bundle.py, `make setup BUNDLE=...`): what unpacking keeps,
what it refuses, and that the set-up from a bundle asks no package index."""

import io
import json
import platform
import re
import subprocess
import tarfile

import pytest

from scripts import bundle


def archive(path, manifest, files):
    """A bundle with this manifest and these {path inside labkit-bundle/: bytes}."""
    with tarfile.open(path, "w") as tar:
        for name, data in {"MANIFEST.json": json.dumps(manifest).encode(), **files}.items():
            info = tarfile.TarInfo(f"{bundle.TOP}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_unpack_places_wheels_and_cache_and_keeps_what_is_there(tmp_path):
    cache = tmp_path / "cache"
    (cache / "entry").mkdir(parents=True)
    (cache / "entry" / "model.safetensors").write_bytes(b"built here")
    src = archive(tmp_path / "b.tar", bundle.target(), {
        "wheels/torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl": b"w",
        "cache/entry/model.safetensors": b"from the bundle",
        "cache/entry/tokenizer/tokenizer.json": b"{}",
        "cache/../escape": b"outside the cache",
    })
    bundle.unpack(src, tmp_path / "wheels", cache)
    assert [p.name for p in (tmp_path / "wheels").iterdir()] == \
        ["torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl"]
    assert (cache / "entry" / "model.safetensors").read_bytes() == b"built here", \
        "unpacking must keep a cache file that is already there"
    assert (cache / "entry" / "tokenizer" / "tokenizer.json").read_bytes() == b"{}"
    assert not (tmp_path / "escape").exists(), "a path with .. must not leave the cache"
    assert not list(cache.rglob("*.partial"))


def test_unpack_refuses_a_bundle_made_for_another_python(tmp_path):
    other = {**bundle.target(), "python": "cpython3.99"}
    src = archive(tmp_path / "b.tar", other, {"wheels/x.whl": b"w"})
    with pytest.raises(SystemExit, match=r"made for cpython3\.99 on .*but this venv runs"):
        bundle.unpack(src, tmp_path / "wheels", tmp_path / "cache")
    assert not (tmp_path / "wheels").exists()


def planned(*args):
    """The commands `make setup` would run for a fresh install (make -n), one per line."""
    out = subprocess.run(["make", "-n", "-W", "requirements.txt", "setup", *args],
                         cwd=bundle.ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if " pip install " in line]


def test_setup_from_a_bundle_asks_no_index():
    lines = planned("BUNDLE=labkit-bundle.tar")
    assert len(lines) == 4, lines
    for line in lines:
        assert "--no-index --find-links .bundle-wheels" in line, \
            f"every install from a bundle must read only its wheels: {line}"


@pytest.mark.skipif(platform.system() != "Linux", reason="the CPU index is the default on Linux")
def test_setup_on_linux_without_a_gpu_takes_torchs_cpu_build():
    lines = planned("NVIDIA_GPU=")
    torch_step = [line for line in lines if '"torch==' in line]
    assert len(torch_step) == 1 and re.search(
        r'--no-index --no-deps "torch==[\d.]+\+cpu".*\|\| .*--index-url '
        r'https://download\.pytorch\.org/whl/cpu "torch==', torch_step[0]), torch_step
    assert not [line for line in planned("TORCH_INDEX=") if '"torch==' in line], \
        "TORCH_INDEX= must leave torch to requirements.txt and the default index"
