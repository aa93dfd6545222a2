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

Three extras ride along: `launch_sample` takes the used tokens of rows with penalties
(`history`) and the drafts of speculative verify rows (`drafts`, on a device that runs them:
`Device.speculative`), and rows that asked for log-probabilities get them back with their
tokens, in the same copy (`logprobs(slot)`, after `wait_tokens`).

`InProcessDevice` runs each launch synchronously in the caller's thread: the simplest correct
device, used by the early notebooks and for debugging.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import queue
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from labkit.runner import ModelRunner, StepPlan
from labkit.sampling import MAX_LOGPROBS, Drafts, History

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


def check_no_verify(device: Device, plan: StepPlan) -> None:
    """Refuse a speculative verify step on a device whose host buffers carry one token a row."""
    if plan.verify is not None:
        raise ValueError(f"step {plan.step} has speculative verify rows, which the {device.name} "
                         "device does not run (its host buffers carry one token per row); "
                         "speculative decoding runs on device='inprocess'")


class Device:
    """Base class: the four launches every device provides."""

    name = "device"
    simulated = False
    speculative = False  # runs verify rows (StepPlan.verify; labkit.speculative)

    def launch_forward(self, slot: int, plan: StepPlan) -> None:
        """Enqueue the step's forward on the compute stream."""
        raise NotImplementedError

    def launch_sample(self, slot: int, plan: StepPlan,
                      allowed: dict[int, torch.Tensor] | None = None,
                      history: History | None = None, drafts: Drafts | None = None) -> None:
        """Enqueue masking and sampling of the slot's logits on the compute stream."""
        raise NotImplementedError

    def launch_copy(self, slot: int) -> None:
        """Enqueue the device-to-host copy of the slot's tokens on the copy stream."""
        raise NotImplementedError

    def wait_tokens(self, slot: int) -> list[int]:
        """Wait for the slot's copy and return its tokens."""
        raise NotImplementedError

    def logprobs(self, slot: int) -> list[list[float]] | None:
        """After `wait_tokens(slot)`: each row's `token_logprobs` row, or None if no row of
        that step asked for log-probabilities."""
        return None

    def spans(self) -> list[tuple[str, str, int, float, float]]:
        """Device spans recorded since the last call: (lane, op, step, t0, t1)."""
        return []

    @property
    def spin_pauses(self) -> tuple[int, int]:
        """(host, device): times a spinning waiter gave up its spin (the simulated device)."""
        return 0, 0

    def host_thread(self) -> contextlib.AbstractContextManager:
        """Context for the host's decode loop (the simulated device keeps it off its core)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Release the device's resources."""


class InProcessDevice(Device):
    """Runs every launch at once, in the caller's thread (synchronous; for debugging)."""

    name = "in-process"
    speculative = True

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._spans: list[tuple[str, str, int, float, float]] = []
        self._logits: list[torch.Tensor | None] = [None] * NUM_SLOTS
        self._tokens: list[torch.Tensor | None] = [None] * NUM_SLOTS
        self._host: list[list[int] | None] = [None] * NUM_SLOTS
        self._logprobs: list[torch.Tensor | None] = [None] * NUM_SLOTS
        self._host_logprobs: list[list[list[float]] | None] = [None] * NUM_SLOTS

    def launch_forward(self, slot: int, plan: StepPlan) -> None:
        t0 = time.perf_counter()
        self._logits[slot] = self.runner.forward(plan)
        self._spans.append(("compute", "forward", plan.step, t0, time.perf_counter()))

    def launch_sample(self, slot: int, plan: StepPlan,
                      allowed: dict[int, torch.Tensor] | None = None,
                      history: History | None = None, drafts: Drafts | None = None) -> None:
        t0 = time.perf_counter()
        logits = self._logits[slot]
        mask = allowed_tensor(allowed, plan.batch_size, logits.shape[-1], logits.device)
        self._tokens[slot] = self.runner.sample(plan, logits, mask, history=history,
                                                drafts=drafts)
        self._logprobs[slot] = self.runner.last_logprobs
        self._logits[slot] = None
        self._spans.append(("compute", "sample", plan.step, t0, time.perf_counter()))

    def spans(self) -> list[tuple[str, str, int, float, float]]:
        out, self._spans = self._spans, []
        return out

    def launch_copy(self, slot: int) -> None:
        self._host[slot] = self._tokens[slot].tolist()
        lp = self._logprobs[slot]
        self._host_logprobs[slot] = None if lp is None else lp.tolist()

    def wait_tokens(self, slot: int) -> list[int]:
        tokens = self._host[slot]  # left in place: waiting twice (after an interrupt) is safe
        assert tokens is not None, f"slot {slot}: wait_tokens without a launched copy"
        return tokens

    def logprobs(self, slot: int) -> list[list[float]] | None:
        return self._host_logprobs[slot]


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


# "link": each command's travel from the host's send to the device taking it (not device work)
_LANES = ("compute", "copy", "link")
# "recv": the device reading and unpickling a command that has arrived; "unpack": turning
# constraint masks sent as bits into tensors. Both are the device's own per-step overhead,
# booked as device time (compute lane) beside forward and sample. The wake-up latency before a
# command arrives at an idle device is not device work: it is the gap between the host's launch
# span and the "recv" span, part of the bubble. "dispatch": the device's own time between
# finishing one command and taking the next when that one was already queued (its loop, the
# ring's read; a GPU's gap between kernels), recorded only then: device time, not a wait.
_OPS = ("forward", "sample", "copy", "recv", "unpack", "dispatch", "command")
_STATUS_OPS = (*_OPS, "fault", "stall")  # what the device says it is doing (the last two: tests)
_TRACE_CAP = 1 << 16  # spans kept per lane (a ring)
_ERROR_CAP = 1 << 16  # bytes of the device's traceback kept in shared memory
MASK_CACHE_CAP = 256  # constraint masks the device keeps (least recently used goes first)
# A GPU never sleeps between kernels, and a CUDA event wait spins before it blocks: neither
# side pays an OS wake-up per step. With a core of its own, the simulated device does the same:
# it polls for the next command this long before it sleeps on the doorbell, and the host sleeps
# through most of a step it waits for, then spins on the copy's stamp (`wait_tokens`). A
# spinner that another program shares a core with loses to it (the OS favours a task that
# slept), so a side that sees most recent events more than SPIN_LATE_S after they happened stops
# spinning for SPIN_PAUSE_S: it blocks, and the OS wakes it ahead of the other program. One late
# event is not enough: a virtual machine's core pauses now and then with nobody else on it, and
# a spinner that paused for each of those blocked most of the time, on a core gone cold
# (measured on tiny at one stream: host work 0.14 -> 0.06 ms a step, round trips 0.07 -> 0.02).
DEVICE_SPIN_S = 0.005
HOST_SPIN_S = 0.002  # the host's spin around the moment the tokens are expected
SPIN_LATE_S = 0.0002
SPIN_PAUSE_S = 1.0
SPIN_LATE_WEIGHT = 0.25  # three late events in a row pause the spin; one is forgotten


class SpinGuard:
    """Whether a spinner still has its core to itself, judged from how late it saw events."""

    def __init__(self) -> None:
        self.late = 0.0  # moving share of recent events seen late
        self.paused_until = 0.0
        self.pauses = 0  # times it stopped spinning

    def spinning(self, now: float) -> bool:
        return now >= self.paused_until

    def saw(self, lateness: float, now: float) -> None:
        """An event happened `lateness` seconds before the spinner saw it."""
        self.late += SPIN_LATE_WEIGHT * ((lateness > SPIN_LATE_S) - self.late)
        if self.late > 0.5:  # most recent events late: another program holds this core
            self.paused_until = now + SPIN_PAUSE_S
            self.late = 0.0
            self.pauses += 1
_HEAD = 2  # a host buffer row: [n, step, token_0 .. token_{n-1}]
_LP_WIDTH = 1 + 2 * MAX_LOGPROBS  # a row of `token_logprobs` at most; one more column holds
# the width used (in row 0), -1 when the step had no log-probabilities


def _mask_cache_put(cache: OrderedDict, key, value, cap: int) -> None:
    """Insert into a bounded LRU (the host mirrors the device's with the same calls)."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > cap:
        cache.popitem(last=False)



class CommandRing:
    """The compute stream's command queue: a ring of bytes in shared memory and a doorbell.

    What a GPU's driver does: the host writes each command into a ring both sides map and rings
    a doorbell; the device takes commands in order. No system call on either side while both
    spin (a pipe cost ~5 us a poll and as much a read here, on the device's critical path once
    the pipeline keeps it busy). One producer (the host), one consumer (the device). The
    doorbell is a semaphore posted once per command: the device spins on it without sleeping
    (`acquire(block=False)`), or sleeps on it when it may not spin; its post and take also order
    the ring's bytes between the two cores. Each command is a 16-byte head and its bytes,
    padded to 8; a length of -1 says the rest of the ring is unused and the next command is at
    its start. Beside each length, the moment the host rang the doorbell for it: how long a
    command travelled is measured from there, not from before the host built it.
    """

    HEAD = 16  # bytes before each command: its length (int64), when it was sent (float64)

    def __init__(self, ctx, capacity: int = 1 << 22):
        assert capacity % 8 == 0
        self.capacity = capacity
        self.buf = torch.zeros(capacity, dtype=torch.uint8).share_memory_()
        self.pos = torch.zeros(2, dtype=torch.int64).share_memory_()  # bytes written, taken
        self.doorbell = ctx.Semaphore(0)
        self._views()

    def _views(self) -> None:
        self._buf, self._pos = self.buf.numpy(), self.pos.numpy()

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_buf", "_pos")}

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self._views()

    def _size(self, n: int) -> int:
        """Bytes a command of n bytes takes in the ring: its head and its bytes, padded to 8."""
        return self.HEAD + (n + 7) // 8 * 8

    def _header(self, off: int, value: int | None = None) -> int:
        view = self._buf[off:off + 8].view(np.int64)
        if value is not None:
            view[0] = value
        return int(view[0])

    def put(self, data: bytes, wait_for_room: Callable[[float], None]) -> None:
        """Append one command and ring the doorbell; `wait_for_room(since)` is called, with
        the `time.monotonic()` the wait began, while the ring is too full (the device has not
        taken enough yet), and may raise."""
        n = len(data)
        need = self._size(n)
        if need > self.capacity:
            raise ValueError(f"a {n}-byte command does not fit the device's {self.capacity}-byte "
                             "command ring")
        w = int(self._pos[0])
        off = w % self.capacity
        skip = self.capacity - off if self.capacity - off < need else 0
        since = time.monotonic()
        while w + skip + need - int(self._pos[1]) > self.capacity:
            wait_for_room(since)
        if skip:
            self._header(off, -1)  # the rest of the ring is unused
            w, off = w + skip, 0
        self._header(off, n)
        self._buf[off + self.HEAD:off + self.HEAD + n] = np.frombuffer(data, np.uint8)
        self._buf[off + 8:off + 16].view(np.float64)[0] = time.perf_counter()  # sent
        self._pos[0] = w + need
        self.doorbell.release()  # after the bytes: the device takes them only after this

    def take(self) -> tuple[bytes, float]:
        """The next command's bytes and when it was sent; only after a successful acquire of
        the doorbell."""
        r = int(self._pos[1])
        off = r % self.capacity
        n = self._header(off)
        if n == -1:
            r, off = r + self.capacity - off, 0
            n = self._header(0)
        data = self._buf[off + self.HEAD:off + self.HEAD + n].tobytes()
        sent = float(self._buf[off + 8:off + 16].view(np.float64)[0])
        self._pos[1] = r + self._size(n)
        return data, sent


def _device_main(model_conn, runner_args, threads, cpus, ring, copy_done, host_tokens,
                 host_logprobs, done_at, trace, trace_n, status, error_flag, error_text, ready,
                 mask_cap) -> None:
    """The device process: runs the compute stream's commands in order, in its main thread.

    The copy is fused into the sample: the sampled tokens are written straight into the shared
    ("pinned") host buffer, stamped with the step, and the copy's event is set at once, as a
    kernel writing into mapped host memory would; the copy lane records that write. (A copy
    thread waiting for its turn on the device's one core delayed the event by a whole forward.)
    """
    import traceback

    if cpus:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)
    try:
        model = model_conn.recv()  # the weights' shared-memory handles (see ProcessDevice)
        model_conn.close()
        runner = ModelRunner(model, *runner_args)
    except BaseException:
        ready.put(traceback.format_exc())
        return
    logits: list[torch.Tensor | None] = [None] * NUM_SLOTS
    plans: list[StepPlan | None] = [None] * NUM_SLOTS  # sent once, with the forward
    masks: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # by content, bounded
    vocab = model.cfg.vocab_size
    # numpy views of the shared memory: a numpy store costs a fraction of a torch one
    trace_np, trace_n_np, host_np = trace.numpy(), trace_n.numpy(), host_tokens.numpy()
    host_lp_np, done_at_np = host_logprobs.numpy(), done_at.numpy()
    spin_ok = bool(cpus)  # spin only on a core of its own
    guard = SpinGuard()  # late commands: blocking waits for a while
    # [op, step, since, masks held, spin pauses]: what the device is doing (op -1: idle)
    status_np = status.numpy()

    def record(lane: int, op: int, step: int, t0: float, t1: float) -> None:
        trace_np[lane, trace_n_np[lane] % _TRACE_CAP] = (op, step, t0, t1)
        trace_n_np[lane] += 1

    import multiprocessing

    # the process that started this one (the host): a pipe whose far end closes when it dies
    # (not the OS parent: under the fork server that is the server, which waits for us)
    host = multiprocessing.parent_process()
    ready.put(None)
    free_since = time.perf_counter()  # when the device last finished a command's work
    try:
        while True:
            status_np[:3] = (-1, -1, free_since)
            spinning = spin_ok and guard.spinning(free_since)
            rung = False
            if spinning:
                spin_until = free_since + DEVICE_SPIN_S
                # a GPU polls its queue: no wake-up between back-to-back commands
                while not (rung := ring.doorbell.acquire(block=False)) and \
                        time.perf_counter() < spin_until:
                    pass
            while not rung:  # idle until a command has arrived (or the host has gone)
                rung = ring.doorbell.acquire(timeout=1.0)
                if not rung and host is not None and not host.is_alive():
                    return  # the host process died without closing us
            arrived = time.perf_counter()
            raw, sent = ring.take()
            msg = pickle.loads(raw)  # plain data: no tensors travel in commands
            got = time.perf_counter()
            if msg is None:
                return
            op, slot, step, payload = msg
            if spinning:
                guard.saw(arrived - max(sent, free_since), arrived)
                status_np[4] = guard.pauses
            if sent < free_since:  # it was queued: the time to take it was the device's own
                record(0, 5, step, free_since, arrived)
            else:  # the device was idle: the command's travel is a round trip's first half
                record(2, 6, step, sent, arrived)
            status_np[:3] = (_STATUS_OPS.index(op), step, got)
            record(0, 3, step, arrived, got)  # "recv": read and unpickle the command
            if op == "forward":
                plans[slot] = payload
                logits[slot] = runner.forward(payload)
                free_since = time.perf_counter()
                record(0, 0, step, got, free_since)
            elif op == "sample":
                plan = plans[slot]
                masks_sent, history = payload
                rows = {}
                for row, (key, packed) in (masks_sent or {}).items():
                    if packed is not None:  # first use of this mask: unpack and keep it
                        bits = np.unpackbits(np.frombuffer(packed, np.uint8))[:vocab]
                        _mask_cache_put(masks, key, torch.from_numpy(bits.astype(bool)), mask_cap)
                    masks.move_to_end(key)
                    rows[row] = masks[key]
                status_np[3] = len(masks)
                t1 = time.perf_counter() if masks_sent else got
                if masks_sent:
                    record(0, 4, step, got, t1)  # "unpack"
                mask = allowed_tensor(rows, plan.batch_size, vocab, runner.device)
                tokens = runner.sample(plan, logits[slot], mask, history=history).numpy()
                logits[slot] = None
                t2 = time.perf_counter()
                n = tokens.shape[0]
                host_np[slot, _HEAD:n + _HEAD] = tokens  # the "copy": into the shared buffer
                host_np[slot, 0] = n
                lp = runner.last_logprobs
                if lp is not None:  # [n, 1 + 2k], k of the row that asked the most
                    host_lp_np[slot, :n, :lp.shape[1]] = lp.numpy()
                host_lp_np[slot, 0, -1] = -1 if lp is None else lp.shape[1]
                done_at_np[slot] = time.perf_counter()  # for the host's wait: when it was ready
                host_np[slot, 1] = step  # the stamp last: a buffer with it is complete
                free_since = time.perf_counter()
                copy_done[slot].release()  # the copy's event
                record(0, 1, step, t1, t2)
                record(1, 2, step, t2, free_since)
            elif op == "fault":  # tests: a failure inside the device
                raise RuntimeError(f"injected device fault: {payload}")
            elif op == "stall":  # tests: a device that is alive but does not answer
                time.sleep(payload)
                free_since = time.perf_counter()
    except BaseException:
        text = traceback.format_exc().encode()[:_ERROR_CAP]
        error_text.numpy()[:len(text)] = np.frombuffer(text, np.uint8)
        error_flag.numpy()[:] = (1, len(text))  # sticky, and written before anyone wakes
        for done in copy_done:
            done.release()
        # returning ends the process: nothing else runs in it


class ProcessDevice(Device):
    """A simulated accelerator: another OS process owns the weights, the KV pool, last_tokens.

    Launching writes a command into the compute stream's ring (`CommandRing`) and returns at
    once; the device process runs the commands in order. Host buffers are shared memory both
    processes map (the stand-in for pinned memory); each copy is stamped with its step, and the
    copy's event is a `multiprocessing.Semaphore` per slot. A process, not a thread: with
    pure-Python host work a device thread would share the GIL with the host and the two could
    not overlap.

    Failures: an error inside the device is written to shared memory (a sticky flag and the
    traceback) before any waiter is woken, and the device process exits; from then on every
    call raises `DeviceError` with that traceback at once. A device that stays alive but does
    not finish anything for `stall_timeout_s` while the host waits is reported as stalled,
    with what it was doing. A host buffer whose stamp is not the awaited step is never read.

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
                 pin: bool = True, attention: str | None = None, stall_timeout_s: float = 120.0,
                 mask_cache_cap: int = MASK_CACHE_CAP):
        import torch.multiprocessing as mp

        split = split_cpus() if pin else None
        self.host_cpus, self.device_cpus = split if split else (None, None)
        self.stall_timeout_s = stall_timeout_s
        self._failed: str | None = None  # the host's copy of the sticky error
        self._closed = False
        # a fork server (POSIX) imports torch and labkit once, then forks each device from
        # itself: a device starts in ~0.1 s, not the ~2 s of a fresh interpreter (spawn), and
        # the devices share the server's pages of the libraries
        if "forkserver" in mp.get_all_start_methods():
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["labkit.device"])
        else:
            ctx = mp.get_context("spawn")
        model.share_memory()  # the device maps the weights; nothing is copied
        self.vocab_size = model.cfg.vocab_size
        self.host_tokens = torch.zeros(NUM_SLOTS, max_seqs + _HEAD,
                                       dtype=torch.long).share_memory_()
        self._host_np = self.host_tokens.numpy()
        self._host_np[:, 1] = -1  # no step's tokens yet
        self.host_logprobs = torch.zeros(NUM_SLOTS, max_seqs, _LP_WIDTH + 1,
                                         dtype=torch.float32).share_memory_()
        self._host_lp_np = self.host_logprobs.numpy()
        self.done_at = torch.zeros(NUM_SLOTS, dtype=torch.float64).share_memory_()
        self._done_at_np = self.done_at.numpy()
        self._expect_s = 0.0  # how long a wait for tokens lasts, from the device's clock (EMA)
        self._guard = SpinGuard()  # late wake-ups: blocking waits for a while
        self.trace = torch.zeros(len(_LANES), _TRACE_CAP, 4, dtype=torch.float64).share_memory_()
        self.trace_n = torch.zeros(len(_LANES), dtype=torch.long).share_memory_()
        self._trace_n_np = self.trace_n.numpy()  # a numpy read: ~0.2 us; a torch index: ~2-20
        self.status = torch.zeros(5, dtype=torch.float64).share_memory_()
        self.mask_cache_cap = mask_cache_cap
        self.error_flag = torch.zeros(2, dtype=torch.long).share_memory_()  # (failed, length)
        self.error_text = torch.zeros(_ERROR_CAP, dtype=torch.uint8).share_memory_()
        self._error_np = self.error_flag.numpy()
        # the copy's completion event: a semaphore, released once per copy (and by a failing
        # device, to wake the host); cheaper than a multiprocessing.Event
        self.copy_done = [ctx.Semaphore(0) for _ in range(NUM_SLOTS)]
        ready = ctx.Queue()
        self._ring = CommandRing(ctx)
        # the model goes through a pipe of its own, after the start: the process's own start
        # writes its arguments into a pipe that the parent keeps open until the write ends, so
        # a child that died first (a script without a `__main__` guard) left that write, and the
        # engine, hanging for good once the model's handles outgrew the pipe's 64 KB. Here the
        # child's end is closed at once, and a send to a dead child raises instead.
        model_r, model_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=_device_main, daemon=True, name="labkit-device",
            args=(model_r, (num_blocks, block_size, max_seqs, cache, "cpu", attention), threads,
                  self.device_cpus, self._ring, self.copy_done, self.host_tokens,
                  self.host_logprobs, self.done_at, self.trace,
                  self.trace_n, self.status, self.error_flag, self.error_text, ready,
                  mask_cache_cap))
        self.proc.start()
        model_r.close()
        try:
            model_w.send(model)
        except OSError:  # the child died before reading it: the loop below says how
            pass
        finally:
            model_w.close()
        self._host_masks: OrderedDict[int, tuple[torch.Tensor, bytes, bytes]] = OrderedDict()
        self._device_masks: OrderedDict[bytes, None] = OrderedDict()  # mirrors the device's
        self._trace_read = [0] * len(_LANES)
        self._slot_step = [-1] * NUM_SLOTS
        deadline = time.monotonic() + start_timeout_s
        while True:  # ready, or an error, or a process that died before it could say either
            try:
                err = ready.get(timeout=0.2)
                break
            except queue.Empty:
                if not self.proc.is_alive():
                    code = self.proc.exitcode
                    self.close()
                    raise DeviceError(
                        f"the device process exited while starting (exit code {code}); if "
                        "this is a script, start the engine under `if __name__ == "
                        "'__main__':` (the device is a new process that imports this "
                        "script)") from None
                if time.monotonic() > deadline:
                    self.close()
                    raise DeviceError("the device process did not start in "
                                      f"{start_timeout_s:.0f} s") from None
        if err is not None:
            self.close()
            raise DeviceError(f"the device process failed to start:\n{err}")

    # -- failures ------------------------------------------------------------------------------

    def _fail(self, message: str) -> None:
        """Make the failure sticky on the host side too, and raise it."""
        self._failed = message
        raise DeviceError(message)

    def _check(self, alive: bool = False) -> None:
        """Raise if the device has failed (the shared flag; with `alive`, a dead process)."""
        if self._failed is not None:
            raise DeviceError(self._failed)
        if self._error_np[0]:
            n = int(self._error_np[1])
            text = bytes(self.error_text.numpy()[:n]).decode(errors="replace")
            self._fail(f"the simulated device failed:\n{text}")
        if alive and not self.proc.is_alive():
            self._check()  # it may have written its error just before exiting
            code = self.proc.exitcode
            self._fail(f"the simulated device process died (exit code {code}); no step "
                       "results will arrive")

    def _doing(self) -> str:
        """What the device reports it is doing, for a stall message."""
        op, step, since = self.status.tolist()[:3]
        ago = time.perf_counter() - since
        if op == -1:
            return f"idle, waiting for a command, for {ago:.1f} s"
        what = _STATUS_OPS[int(op)]
        return f"running {what} of step {int(step)} for {ago:.1f} s"

    def _send(self, cmd) -> None:
        self._check()
        # plain pickle: a plan is lists and numbers (multiprocessing's reducer, which can pass
        # tensors, cost ~20 us a command)
        self._ring.put(pickle.dumps(cmd, protocol=pickle.HIGHEST_PROTOCOL), self._wait_for_room)

    def _wait_for_room(self, since: float) -> None:
        """The command ring is full: the device is behind by 4 MB of commands, or stuck."""
        self._check(alive=True)
        if time.monotonic() - since > self.stall_timeout_s:
            self._fail(f"the simulated device stalled: its command ring stayed full for "
                       f"{self.stall_timeout_s:.0f} s; the device was {self._doing()}")
        time.sleep(0.0005)

    # -- the four launches ---------------------------------------------------------------------

    def launch_forward(self, slot: int, plan: StepPlan) -> None:
        check_no_verify(self, plan)
        self._send(("forward", slot, plan.step, plan))

    def _mask_payload(self, allowed: dict[int, torch.Tensor]) -> dict:
        """Each row's mask as (content key, bits or None if the device holds it already)."""
        payload = {}
        for row, mask in allowed.items():
            # host side: a mask object seen before is not packed again (kept alive, so its id
            # cannot be reused by another tensor while it is in this bounded cache)
            hit = self._host_masks.get(id(mask))
            if hit is None or hit[0] is not mask:
                packed = np.packbits(mask.numpy()).tobytes()
                hit = (mask, hashlib.blake2b(packed, digest_size=16).digest(), packed)
                self._host_masks[id(mask)] = hit
                while len(self._host_masks) > self.mask_cache_cap:
                    self._host_masks.popitem(last=False)
            self._host_masks.move_to_end(id(mask))
            _, key, packed = hit
            if key in self._device_masks:  # the same LRU moves as the device will make
                self._device_masks.move_to_end(key)
                payload[row] = (key, None)
            else:
                _mask_cache_put(self._device_masks, key, None, self.mask_cache_cap)
                payload[row] = (key, packed)
        return payload

    def launch_sample(self, slot: int, plan: StepPlan,
                      allowed: dict[int, torch.Tensor] | None = None,
                      history: History | None = None, drafts: Drafts | None = None) -> None:
        masks = self._mask_payload(allowed) if allowed else None
        self._slot_step[slot] = plan.step
        # the device kept the slot's plan from the forward: only masks and history travel
        self._send(("sample", slot, plan.step, (masks, history)))

    def launch_copy(self, slot: int) -> None:
        """Nothing to send: the sample writes the slot's host buffer itself (see the module)."""
        self._check()

    def _spin_for(self, slot: int, step: int) -> bool:
        """Sleep through most of the expected wait, then spin on the stamp (a CUDA event wait
        spins too): the host sees the tokens microseconds after they land, not an OS wake-up
        later. Only with the device on a core of its own, else spinning would starve it.
        True if the stamp arrived while spinning."""
        if self.device_cpus is None or not self._guard.spinning(time.perf_counter()):
            return False
        host, t0 = self._host_np, time.perf_counter()
        # sleep through 90% of the expected wait, spin through the rest and 30% beyond it
        # (a step's time varies by more than a fixed margin on a long step)
        wake = t0 + 0.9 * self._expect_s - HOST_SPIN_S
        if wake - t0 > 0.001 and int(host[slot, 1]) != step:
            if self.copy_done[slot].acquire(timeout=wake - t0):
                self.copy_done[slot].release()  # not ours to take here: the wait loop counts
        until = t0 + 1.3 * self._expect_s + 2 * HOST_SPIN_S
        spun = now = time.perf_counter()
        while int(host[slot, 1]) != step and (now := time.perf_counter()) < until:
            pass
        if int(host[slot, 1]) != step:
            return False
        done = float(self._done_at_np[slot])
        if done > spun:
            self._guard.saw(now - done, now)
        return True

    def wait_tokens(self, slot: int) -> list[int]:
        """Wait for the slot's stamped tokens; a failed or stalled device raises DeviceError."""
        step = self._slot_step[slot]
        host = self._host_np
        entered = time.perf_counter()
        if self._spin_for(slot, step):
            # the fast path: the stamp is there. The device sets the copy's event just after
            # the stamp; take it (a few microseconds at most) so that the count stays one per
            # copy, and a later blocking wait does not wake for this one
            until = time.perf_counter() + 0.001
            while not self.copy_done[slot].acquire(block=False) and time.perf_counter() < until:
                pass
        else:
            self._wait_blocking(slot, step)
        # the device's own clock says how long this wait had to be: the next one sleeps that
        waited = max(0.0, float(self._done_at_np[slot]) - entered)
        self._expect_s += 0.25 * (waited - self._expect_s)
        n = int(host[slot, 0])
        return host[slot, _HEAD:n + _HEAD].tolist()

    def _wait_blocking(self, slot: int, step: int) -> None:
        """Block on the copy's event until the slot holds `step`'s stamp; raise DeviceError
        for a failed device, or one that finished nothing for `stall_timeout_s`."""
        host = self._host_np
        acquired = False
        progress, since = int(self._trace_n_np[0]), time.monotonic()
        while True:
            self._check()
            stamp = int(host[slot, 1])
            if stamp == step:
                break
            if stamp > step:
                self._fail(f"slot {slot} holds step {stamp}'s tokens while the host waits for "
                           f"step {step}: the streams are out of order")
            if self.copy_done[slot].acquire(timeout=0.25):
                acquired = True
                continue
            self._check(alive=True)
            if int(self._trace_n_np[0]) != progress:  # the device finished something
                progress, since = int(self._trace_n_np[0]), time.monotonic()
            elif time.monotonic() - since > self.stall_timeout_s:
                self._fail(f"the simulated device stalled: nothing finished for "
                           f"{self.stall_timeout_s:.0f} s while the host waited for step "
                           f"{step}'s tokens (slot {slot}); the device was {self._doing()}")
        if not acquired:  # the copy's event fired before we waited: take it, keep the count
            self.copy_done[slot].acquire(block=False)

    def logprobs(self, slot: int) -> list[list[float]] | None:
        width = int(self._host_lp_np[slot, 0, -1])
        if width < 0:
            return None
        n = int(self._host_np[slot, 0])
        return self._host_lp_np[slot, :n, :width].tolist()

    # -- failure injection (tests) -------------------------------------------------------------

    def inject(self, what: str, arg=None) -> None:
        """Tests: make the device fail ("fault") or stop answering for `arg` s ("stall")."""
        assert what in ("fault", "stall"), what
        self._send((what, 0, -1, arg))

    @property
    def masks_held(self) -> int:
        """Constraint masks the device process holds now (at most `mask_cache_cap`)."""
        return int(self.status[3])

    @property
    def spin_pauses(self) -> tuple[int, int]:
        """(host, device): how many times each side stopped spinning because it saw events
        late (another program shares its core). Both 0: every round trip was a spin's."""
        return self._guard.pauses, int(self.status[4])

    def spans(self) -> list[tuple[str, str, int, float, float]]:
        """Device spans recorded since the last call: (lane, op, step, t0, t1)."""
        out = []
        for lane in range(len(_LANES)):
            n = int(self._trace_n_np[lane])
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
        """Stop the device process: politely if it is healthy, at once if it failed."""
        if self._closed:
            return
        self._closed = True
        healthy = self._failed is None and not self._error_np[0] and self.proc.is_alive()
        if healthy:
            with contextlib.suppress(DeviceError):
                self._ring.put(pickle.dumps(None), self._wait_for_room)
            self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
