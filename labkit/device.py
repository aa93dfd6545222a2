"""The device interface the decoders launch work through.

Shaped like CUDA's own model: work is *launched* onto a stream and runs in order; the host learns
it finished by waiting on an event; results come back through a host buffer. The decoders only
ever call these four methods, so the same decoder code runs on every device:

- `launch_forward(slot, plan)`: the step's forward, into decode slot `slot` (compute stream);
- `launch_sample(slot, plan, allowed)`: masks and sampling on that slot's logits (compute
  stream); the sampled tokens also land in the device's `last_tokens`, where the next forward
  reads them;
- `launch_copy(slot)`: device-to-host copy of the sampled tokens into the slot's host buffer
  (copy stream, after the sample);
- `wait_tokens(slot)`: block until that copy is done and return the tokens.

`InProcessDevice` runs each launch synchronously in the caller's thread: the simplest correct
device, used by the early notebooks and for debugging.
"""

from __future__ import annotations

import contextlib
import os
import queue
import time

import numpy as np
import torch

from labkit.runner import ModelRunner, StepPlan

NUM_SLOTS = 2  # ping-pong: step t+1 never overwrites what the host still reads of step t


def allowed_tensor(allowed: dict[int, torch.Tensor] | None, batch: int, vocab: int,
                   device: torch.device) -> torch.Tensor | None:
    """The [B, V] bool mask from per-row masks (rows without one allow every token)."""
    if not allowed:
        return None
    rows = sorted(allowed)
    stacked = torch.stack([allowed[r] for r in rows]).to(device, non_blocking=True)
    if len(rows) == batch:  # every row constrained: the stack is the mask
        return stacked
    mask = torch.ones(batch, vocab, dtype=torch.bool, device=device)
    mask[torch.tensor(rows, device=device)] = stacked  # one copy, not one per row
    return mask


class Device:
    """Base class: the four launches every device provides."""

    name = "device"
    simulated = False

    def launch_forward(self, slot: int, plan: StepPlan) -> None:
        """Enqueue the step's forward on the compute stream."""
        raise NotImplementedError

    def launch_sample(self, slot: int, plan: StepPlan,
                      allowed: dict[int, torch.Tensor] | None = None) -> None:
        """Enqueue masking and sampling of the slot's logits on the compute stream."""
        raise NotImplementedError

    def launch_copy(self, slot: int) -> None:
        """Enqueue the device-to-host copy of the slot's tokens on the copy stream."""
        raise NotImplementedError

    def wait_tokens(self, slot: int) -> list[int]:
        """Wait for the slot's copy and return its tokens."""
        raise NotImplementedError

    def spans(self) -> list[tuple[str, str, int, float, float]]:
        """Device spans recorded since the last call: (lane, op, step, t0, t1)."""
        return []

    def host_thread(self) -> contextlib.AbstractContextManager:
        """Context for the host's decode loop (the simulated device keeps it off its core)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Release the device's resources."""


class InProcessDevice(Device):
    """Runs every launch at once, in the caller's thread (synchronous; for debugging)."""

    name = "in-process"

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._spans: list[tuple[str, str, int, float, float]] = []
        self._logits: list[torch.Tensor | None] = [None] * NUM_SLOTS
        self._tokens: list[torch.Tensor | None] = [None] * NUM_SLOTS
        self._host: list[list[int] | None] = [None] * NUM_SLOTS

    def launch_forward(self, slot: int, plan: StepPlan) -> None:
        t0 = time.perf_counter()
        self._logits[slot] = self.runner.forward(plan)
        self._spans.append(("compute", "forward", plan.step, t0, time.perf_counter()))

    def launch_sample(self, slot: int, plan: StepPlan,
                      allowed: dict[int, torch.Tensor] | None = None) -> None:
        t0 = time.perf_counter()
        logits = self._logits[slot]
        mask = allowed_tensor(allowed, plan.batch_size, logits.shape[-1], logits.device)
        self._tokens[slot] = self.runner.sample(plan, logits, mask)
        self._logits[slot] = None
        self._spans.append(("compute", "sample", plan.step, t0, time.perf_counter()))

    def spans(self) -> list[tuple[str, str, int, float, float]]:
        out, self._spans = self._spans, []
        return out

    def launch_copy(self, slot: int) -> None:
        self._host[slot] = self._tokens[slot].tolist()

    def wait_tokens(self, slot: int) -> list[int]:
        tokens, self._host[slot] = self._host[slot], None
        assert tokens is not None, f"slot {slot}: wait_tokens without a launched copy"
        return tokens


# ---------------------------------------------------------------------------------------------
# The simulated accelerator: a separate process (CPU-only machines)
# ---------------------------------------------------------------------------------------------

class DeviceError(RuntimeError):
    """The device failed or died; the host gets this instead of hanging."""


def split_cpus() -> tuple[set[int], set[int]] | None:
    """(host cores, device core): the last core this process may run on goes to the device.

    None where cores cannot be pinned (macOS, Windows) or there is only one: the operating
    system then shares them as it likes.
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return set(cpus[:-1]), {cpus[-1]}


_LANES = ("compute", "copy")
_OPS = ("forward", "sample", "copy")
_TRACE_CAP = 1 << 16  # spans kept per lane (a ring)


def _device_main(model, runner_args, threads, cpus, compute_rx, copy_rx, copy_done, host_tokens,
                 trace, trace_n, errors) -> None:
    """The device process: one thread per stream, each running its commands in order."""
    import threading
    import traceback

    if cpus:  # before any thread starts: the streams and torch's pool inherit it
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)
    try:
        runner = ModelRunner(model, *runner_args)
    except BaseException:
        errors.put(traceback.format_exc())
        for done in copy_done:
            done.release()
        return
    logits: list[torch.Tensor | None] = [None] * NUM_SLOTS
    tokens: list[torch.Tensor | None] = [None] * NUM_SLOTS
    plans: list[StepPlan | None] = [None] * NUM_SLOTS  # sent once, with the forward
    sampled = [threading.Event() for _ in range(NUM_SLOTS)]  # the compute stream's events
    masks: dict[int, torch.Tensor] = {}  # constraint masks, cached by the host's key
    vocab = model.cfg.vocab_size

    # numpy views of the shared memory: a numpy store costs a fraction of a torch one, and on
    # the device's one core the copy stream's every microsecond delays the compute stream
    trace_np, trace_n_np, host_np = trace.numpy(), trace_n.numpy(), host_tokens.numpy()

    def record(lane: int, op: int, step: int, t0: float, t1: float) -> None:
        # t1 is taken before the event is set: once it is, the other stream and the host run,
        # and a span ended after that would swallow their time
        trace_np[lane, trace_n_np[lane] % _TRACE_CAP] = (op, step, t0, t1)
        trace_n_np[lane] += 1

    def fail() -> None:
        errors.put(traceback.format_exc())
        for done in copy_done:  # wake the host: it finds the error instead of waiting forever
            done.release()

    def compute_stream() -> None:
        try:
            while (cmd := compute_rx.recv()) is not None:
                t0 = time.perf_counter()
                op, slot, plan, allowed = cmd
                if op == "forward":
                    plans[slot] = plan
                    logits[slot] = runner.forward(plan)
                else:
                    plan = plans[slot]
                    for key, packed in (allowed or {}).values():
                        if packed is not None:  # first use of this mask: unpack and keep it
                            bits = np.unpackbits(np.frombuffer(packed, np.uint8))[:vocab]
                            masks[key] = torch.from_numpy(bits.astype(bool))
                    rows = {r: masks[key] for r, (key, _) in (allowed or {}).items()}
                    mask = allowed_tensor(rows, plan.batch_size, vocab, runner.device)
                    tokens[slot] = runner.sample(plan, logits[slot], mask)
                    logits[slot] = None
                t1 = time.perf_counter()
                if op == "sample":
                    sampled[slot].set()
                record(0, _OPS.index(op), plan.step, t0, t1)
        except BaseException:
            fail()

    def copy_stream() -> None:
        try:
            while (cmd := copy_rx.recv()) is not None:
                slot, step = cmd
                sampled[slot].wait()  # the copy stream waits on the compute stream's event
                sampled[slot].clear()
                t0 = time.perf_counter()
                n = tokens[slot].shape[0]
                host_np[slot, 0] = n
                host_np[slot, 1:n + 1] = tokens[slot].numpy()  # into the shared "pinned" buffer
                t1 = time.perf_counter()
                copy_done[slot].release()
                record(1, 2, step, t0, t1)
        except BaseException:
            fail()

    streams = [threading.Thread(target=compute_stream), threading.Thread(target=copy_stream)]
    for s in streams:
        s.start()
    errors.put(None)  # ready
    for s in streams:
        s.join()


class ProcessDevice(Device):
    """A simulated accelerator: another OS process owns the weights, the KV pool, last_tokens.

    Launching sends a command down a stream's pipe and returns at once; the device process
    runs each stream's commands in order in its own thread. Host buffers are shared memory
    both processes map (the stand-in for pinned memory); the copy stream signals the host
    through a `multiprocessing.Semaphore` per slot (the copy's event).
    A process, not a thread: with pure-Python host work a device thread would share the GIL
    with the host and the two could not overlap.

    With `pin` (the default, where the OS allows it), the device process runs on one core and
    the host's decode loop (inside `host_thread()`) on the others, as a GPU and a CPU would.
    Unpinned on a 2-core machine, the scheduler lets the host's commit preempt the device's
    forward: measured, the pipelined loop then lost most of its gain at 32 streams (blocking
    11.1 ms/step, pipelined 11.2) where pinned it made +26% (9.8 -> 7.8).
    """

    name = "simulated accelerator (cpu process)"
    simulated = True

    def __init__(self, model, num_blocks: int, block_size: int, max_seqs: int,
                 cache: str = "paged", threads: int = 1, start_timeout_s: float = 120.0,
                 pin: bool = True, attention: str | None = None):
        import torch.multiprocessing as mp

        split = split_cpus() if pin else None
        self.host_cpus, self.device_cpus = split if split else (None, None)
        ctx = mp.get_context("spawn")
        model.share_memory()  # the device maps the weights; nothing is copied
        self.vocab_size = model.cfg.vocab_size
        self.host_tokens = torch.zeros(NUM_SLOTS, max_seqs + 1, dtype=torch.long).share_memory_()
        self._host_np = self.host_tokens.numpy()
        self.trace = torch.zeros(2, _TRACE_CAP, 4, dtype=torch.float64).share_memory_()
        self.trace_n = torch.zeros(2, dtype=torch.long).share_memory_()
        # the copy's completion event: a semaphore, released once per copy, acquired once per
        # wait (cheaper than a multiprocessing.Event, whose set() waits for every waiter)
        self.copy_done = [ctx.Semaphore(0) for _ in range(NUM_SLOTS)]
        self._errors = ctx.Queue()
        compute_rx, self._compute = ctx.Pipe(duplex=False)
        copy_rx, self._copy = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=_device_main, daemon=True, name="labkit-device",
            args=(model, (num_blocks, block_size, max_seqs, cache, "cpu", attention), threads,
                  self.device_cpus, compute_rx, copy_rx, self.copy_done, self.host_tokens,
                  self.trace, self.trace_n, self._errors))
        self.proc.start()
        self._mask_keys: dict[int, tuple[int, torch.Tensor]] = {}
        self._trace_read = [0, 0]
        self._slot_step = [0] * NUM_SLOTS
        self._closed = False
        deadline = time.monotonic() + start_timeout_s
        while True:  # ready, or an error, or a process that died before it could say either
            try:
                err = self._errors.get(timeout=0.2)
                break
            except queue.Empty:
                if not self.proc.is_alive():
                    code = self.proc.exitcode
                    self.close()
                    raise DeviceError(
                        f"the device process exited while starting (exit code {code}); if "
                        "this is a script, start the engine under `if __name__ == "
                        "'__main__':` (the device is a spawned process)") from None
                if time.monotonic() > deadline:
                    self.close()
                    raise DeviceError("the device process did not start in "
                                      f"{start_timeout_s:.0f} s") from None
        if err is not None:
            self.close()
            raise DeviceError(f"the device process failed to start:\n{err}")

    def _send(self, pipe, cmd) -> None:
        try:
            pipe.send(cmd)
        except (BrokenPipeError, OSError):
            self._raise_dead()

    def _raise_dead(self) -> None:
        try:
            err = self._errors.get_nowait()
        except queue.Empty:
            err = None
        code = self.proc.exitcode
        raise DeviceError("the simulated device process died"
                          + (f" (exit code {code})" if code is not None else "")
                          + (f":\n{err}" if err else "; no step results will arrive"))

    def launch_forward(self, slot: int, plan: StepPlan) -> None:
        self._send(self._compute, ("forward", slot, plan, None))

    def launch_sample(self, slot: int, plan: StepPlan,
                      allowed: dict[int, torch.Tensor] | None = None) -> None:
        packed = None
        if allowed:
            packed = {}
            for row, mask in allowed.items():
                key = id(mask)
                if key in self._mask_keys:  # the device has it already
                    packed[row] = (key, None)
                else:  # keep the tensor alive so its id stays unique
                    self._mask_keys[key] = mask
                    packed[row] = (key, np.packbits(mask.numpy()).tobytes())
        self._slot_step[slot] = plan.step
        # the device kept the slot's plan from the forward: only the masks travel
        self._send(self._compute, ("sample", slot, None, packed))

    def launch_copy(self, slot: int) -> None:
        self._send(self._copy, (slot, self._slot_step[slot]))

    def wait_tokens(self, slot: int) -> list[int]:
        while not self.copy_done[slot].acquire(timeout=0.5):
            if not self.proc.is_alive():
                self._raise_dead()
        if not self._errors.empty():
            self._raise_dead()
        n = int(self._host_np[slot, 0])
        return self._host_np[slot, 1:n + 1].tolist()

    def spans(self) -> list[tuple[str, str, int, float, float]]:
        """Device spans recorded since the last call: (lane, op, step, t0, t1)."""
        out = []
        for lane in range(2):
            n = int(self.trace_n[lane])
            start = max(self._trace_read[lane], n - _TRACE_CAP)
            for i in range(start, n):
                op, step, t0, t1 = self.trace[lane, i % _TRACE_CAP].tolist()
                out.append((_LANES[lane], _OPS[int(op)], int(step), t0, t1))
            self._trace_read[lane] = n
        return out

    @contextlib.contextmanager
    def host_thread(self):
        """Keep the calling thread off the device's core while the block runs, then restore."""
        if not self.host_cpus:
            yield
            return
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, self.host_cpus)
        try:
            yield
        finally:
            os.sched_setaffinity(0, before)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for pipe in (self._compute, self._copy):
            try:
                pipe.send(None)
            except (BrokenPipeError, OSError):
                pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
