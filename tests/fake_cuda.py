"""A fake CUDA for machines without a GPU: labkit's CUDA device runs on the CPU, and a hidden
host-device sync raises.

`install()` (or `with fake_cuda():`) swaps what labkit's CUDA path touches:

- `torch.cuda.is_available()` is True; tensors asked for on "cuda" are made on the CPU (a
  `TorchFunctionMode` rewrites the device), so a `torch.device("cuda")` still says "cuda" and
  the code takes its CUDA branches (pinned staging, non-blocking copies);
- streams, events (timed with the host clock), `synchronize`, `record_stream`: fakes that
  check their use (waiting on an event that was never recorded raises);
- `pin_memory` returns a copy (counted in `STATE.pinned`);
- `torch.cuda.graph` records every aten op the captured step runs; `CUDAGraph.replay()` reruns
  them on the same tensors, writing each result where the capture wrote it, so a replay reads
  the current contents of its input buffers, as a real graph does, and any host logic of the
  step is *not* rerun, as in a real graph;
- during a capture, and inside a non-default stream's block while
  `torch.cuda.set_sync_debug_mode("error")` is on, anything that would make the host wait for a
  GPU raises `HostSync`: `.item()`, `.tolist()`, `int()`/`float()`/`bool()` of a tensor,
  `nonzero`, boolean-mask indexing, `masked_select`, `repeat_interleave` without its size.

With `LABKIT_FAKE_CUDA=1` in the environment, tests/conftest.py and
tests/fake_site/sitecustomize.py install it at start-up, so `scripts/gpu_check.sh` runs its
whole flow here (`make gpu-dry-run`).
"""

from __future__ import annotations

import contextlib
import time
import types

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

NAME = "Fake CUDA (CPU, tests/fake_cuda.py)"


class HostSync(RuntimeError):
    """The host would wait for the GPU here (a sync hidden in a step)."""


class _State:
    """What the fake knows: installed or not, the current stream, the sync rules in force."""

    def __init__(self):
        self.installed = False
        self.saved: list[tuple[object, str, object]] = []
        self.remap: _RemapCuda | None = None
        self.stream: FakeStream | None = None  # the current stream (None: the default one)
        self.sync_debug_mode = 0  # 0 off, 1 warn (ignored here), 2 error
        self.capturing = False
        self.pinned = 0  # pin_memory() calls
        self.replays = 0  # CUDAGraph.replay() calls
        self.captures = 0  # graphs captured
        self.capture_errors: list[str] = []  # exceptions raised inside a capture


STATE = _State()


# --- syncs: what makes the host wait for the device ----------------------------------------------

_SYNC_METHODS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__"}
_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique",
             "_unique2", "unique_consecutive", "unique_dim", "equal", "is_nonzero"}
_INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}


class _NoSyncFunctions(TorchFunctionMode):
    """Raise on the Python-level reads of a tensor's values (`.tolist()` does not dispatch)."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _SYNC_METHODS:
            raise HostSync(f"Tensor.{name}() {self.where}: it copies a value to the host, so "
                           "the host waits for every kernel before it; keep the value on the "
                           "host side (the plan knows it) or on the device")
        return func(*args, **(kwargs or {}))


class _NoSyncDispatch(TorchDispatchMode):
    """Raise on the aten ops whose output shape or value needs the device's data."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        bad = name in _SYNC_OPS
        if name == "repeat_interleave" and kwargs.get("output_size") is None and \
                isinstance(args[0], torch.Tensor) and len(args) < 3:
            bad = True
        if name in _INDEX_OPS and len(args) > 1:
            bad = any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                      for i in args[1] if i is not None)
            name = f"{name} by a boolean mask"
        if bad:
            raise HostSync(f"aten.{name} {self.where}: its result depends on the device's data "
                           "(a host-device sync; a CUDA graph cannot capture it)")
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_sync(where: str):
    """Inside the block, any host-device sync raises `HostSync`."""
    with _NoSyncFunctions(where), _NoSyncDispatch(where):
        yield


# --- tensors on "cuda" live on the CPU ------------------------------------------------------------

def _cpu(d):
    if isinstance(d, torch.device) and d.type == "cuda":
        return torch.device("cpu")
    if isinstance(d, str) and d.startswith("cuda"):
        return "cpu"
    return d


class _RemapCuda(TorchFunctionMode):
    """Every tensor asked for on "cuda" is made on the CPU; pin_memory=True makes a copy."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        pin = kwargs.pop("pin_memory", False)
        name = getattr(func, "__name__", "")
        if name == "to":
            args = tuple(_cpu(a) for a in args)
        elif name == "cuda":
            return args[0]
        out = func(*args, **kwargs)
        if pin:
            STATE.pinned += 1
        return out


def _pin_memory(self, *args, **kwargs):
    STATE.pinned += 1
    return self.clone()  # page-locked memory is another buffer: a copy, never an alias


def _record_stream(self, stream):
    assert isinstance(stream, FakeStream), f"record_stream needs a CUDA stream, got {stream!r}"


# --- streams, events, graphs ---------------------------------------------------------------------

class FakeEvent:
    """A CUDA event: recorded on a stream; the work before it is done at once (the CPU ran it)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self.enable_timing = enable_timing
        self.t: float | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        if STATE.capturing:
            raise HostSync("Event.record() inside a CUDA graph capture (labkit records its "
                           "timing events outside the graph)")
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def wait(self, stream: FakeStream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        if STATE.capturing:
            raise HostSync("Event.synchronize() during a CUDA graph capture")
        assert self.t is not None, "the host waits on an event that was never recorded"

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.enable_timing and end.enable_timing, "elapsed_time needs enable_timing=True"
        assert self.t is not None and end.t is not None, "elapsed_time of an unrecorded event"
        return (end.t - self.t) * 1e3


class FakeStream:
    """A CUDA stream: work is run at once, in order, on the CPU."""

    def __init__(self, device=None, priority: int = 0):
        self.device = device

    def wait_event(self, event: FakeEvent) -> None:
        assert isinstance(event, FakeEvent), event

    def wait_stream(self, stream: FakeStream) -> None:
        pass

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        if STATE.capturing:
            raise HostSync("Stream.synchronize() during a CUDA graph capture")
        if STATE.sync_debug_mode == 2:
            raise HostSync("Stream.synchronize() under set_sync_debug_mode('error')")


_DEFAULT_STREAM = FakeStream()


@contextlib.contextmanager
def _stream(stream: FakeStream | None):
    """torch.cuda.stream(s): work in the block goes to `s`; a block on a side stream runs
    under the sync rules when the sync debug mode is "error" (the launches of a step)."""
    before, STATE.stream = STATE.stream, stream
    try:
        if STATE.sync_debug_mode == 2 and stream not in (None, _DEFAULT_STREAM) \
                and not STATE.capturing:
            with no_sync("under set_sync_debug_mode('error')"):
                yield
        else:
            yield
    finally:
        STATE.stream = before


class _Recorder(TorchDispatchMode):
    """Every aten op a capture runs, with its arguments and results (the same tensor objects)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class FakeGraph:
    """A CUDA graph: the ops of one captured step, rerun on the same tensors."""

    def __init__(self, keep_graph: bool = False):
        self.ops: list[tuple] | None = None
        self._pool = object()

    def pool(self):
        return self._pool

    def replay(self) -> None:
        assert self.ops is not None, "replay() of a graph that was never captured"
        STATE.replays += 1
        with torch.inference_mode():
            for func, args, kwargs, outs in self.ops:
                new = func(*args, **kwargs)
                if not outs:
                    continue
                news = [new] if isinstance(new, torch.Tensor) else tree_flatten(new)[0]
                for (o, ptr), n in zip(outs, news):
                    if o is None or o is n or ptr == n.untyped_storage().data_ptr():
                        continue  # not a tensor, or a view of memory the graph already holds
                    o.copy_(n)  # the result lands where the capture put it

    def reset(self) -> None:
        self.ops = None


@contextlib.contextmanager
def _graph(graph: FakeGraph, pool=None, stream: FakeStream | None = None,
           capture_error_mode: str = "global"):
    """torch.cuda.graph: the block runs once (recorded), under the sync rules."""
    assert not STATE.capturing, "a CUDA graph capture inside another"
    assert stream not in (None, _DEFAULT_STREAM) or STATE.stream not in (None, _DEFAULT_STREAM), \
        "capture on a side stream (torch.cuda.graph does this for you; labkit passes its own)"
    rec = _Recorder()
    STATE.capturing = True
    try:
        with _stream(stream or STATE.stream), rec, no_sync("during a CUDA graph capture"):
            yield
    except BaseException as err:
        STATE.capture_errors.append(f"{type(err).__name__}: {err}")
        raise
    finally:
        STATE.capturing = False
    graph.ops = []
    for func, args, kwargs, out in rec.ops:  # each result's tensors, and where they live
        outs = [(o, o.untyped_storage().data_ptr()) if isinstance(o, torch.Tensor) else (None, 0)
                for o in tree_flatten(out)[0]]
        graph.ops.append((func, args, kwargs, outs if any(o is not None for o, _ in outs) else []))
    STATE.captures += 1


def _synchronize(device=None) -> None:
    if STATE.capturing:
        raise HostSync("torch.cuda.synchronize() during a CUDA graph capture")


def _set_sync_debug_mode(mode) -> None:
    STATE.sync_debug_mode = {"default": 0, "warn": 1, "error": 2}.get(mode, mode)


def _properties(device=None):
    return types.SimpleNamespace(name=NAME, total_memory=8 << 30, multi_processor_count=1,
                                 major=9, minor=0, L2_cache_size=1 << 20)


_FAKES = {
    "is_available": lambda: True,
    "device_count": lambda: 1,
    "current_device": lambda: 0,
    "get_device_name": lambda device=None: NAME,
    "get_device_properties": _properties,
    "get_device_capability": lambda device=None: (9, 0),
    "synchronize": _synchronize,
    "Stream": FakeStream,
    "Event": FakeEvent,
    "CUDAGraph": FakeGraph,
    "graph": _graph,
    "graph_pool_handle": object,
    "stream": _stream,
    "current_stream": lambda device=None: STATE.stream or _DEFAULT_STREAM,
    "default_stream": lambda device=None: _DEFAULT_STREAM,
    "set_sync_debug_mode": _set_sync_debug_mode,
    "get_sync_debug_mode": lambda: STATE.sync_debug_mode,
    "is_current_stream_capturing": lambda: STATE.capturing,
    "empty_cache": lambda: None,
    "manual_seed": lambda seed: None,
    "memory_allocated": lambda device=None: 0,
    "max_memory_allocated": lambda device=None: 0,
    "reset_peak_memory_stats": lambda device=None: None,
}


def install() -> bool:
    """Swap in the fake CUDA (process-wide, this thread's tensors); False if already in."""
    if STATE.installed:
        return False
    for name, fake in _FAKES.items():
        STATE.saved.append((torch.cuda, name, getattr(torch.cuda, name, None)))
        setattr(torch.cuda, name, fake)
    for name, fake in (("pin_memory", _pin_memory), ("record_stream", _record_stream)):
        STATE.saved.append((torch.Tensor, name, getattr(torch.Tensor, name)))
        setattr(torch.Tensor, name, fake)
    STATE.remap = _RemapCuda()
    STATE.remap.__enter__()
    STATE.installed = True
    return True


def uninstall() -> None:
    """Put the real torch.cuda back."""
    if not STATE.installed:
        return
    STATE.remap.__exit__(None, None, None)
    for owner, name, real in reversed(STATE.saved):
        if real is None:
            delattr(owner, name)
        else:
            setattr(owner, name, real)
    STATE.saved.clear()
    STATE.sync_debug_mode = 0
    STATE.installed = False


@contextlib.contextmanager
def fake_cuda():
    """The fake CUDA inside the block (left in place if it was installed before)."""
    mine = install()
    try:
        yield STATE
    finally:
        if mine:
            uninstall()
