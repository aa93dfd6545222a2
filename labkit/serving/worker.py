"""The engine thread: the one thread that ever touches the engine, behind the HTTP server.

The HTTP side (`labkit.serving.server`) parses a request and hands each of its prompts to
`EngineWorker` as a `Job`. The worker runs the engine's decode loop in its own thread; new jobs
and cancels wait in an inbox that the loop drains *between steps* (`engine.on_step`), so a
request that arrives while others decode joins the running batch at the next step: continuous
batching, over HTTP. Each job's text, its completion or its failure goes back to the HTTP side
as events on the job's asyncio queue.

If the loop itself dies, every job, queued ones too, is answered with a one-line 500 and no new
job is taken; on shutdown every job that runs or waits is cancelled and answered with a 503.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from labkit.decoders import run
from labkit.engine import Engine
from labkit.sampling import SamplingParams
from labkit.scheduler import RequestError
from labkit.serving.protocol import one_line


@dataclass(eq=False)
class Job:
    """One prompt of an HTTP request inside the engine: its ids and settings, and where its
    events go: (index, "text", piece), (index, "done", completion) or (index, "failed",
    (http status, one-line message)). The prompts of one request share one queue."""

    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    index: int = 0  # the choice it answers
    request_id: int | None = None
    stopped_by_text: bool = False  # the HTTP side met a stop string and cancelled it
    fork_of: Job | None = None  # parallel sampling: the job whose prompt this one shares

    def send(self, kind: str, value: Any) -> None:
        """Deliver an event to the HTTP side (called from the engine thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, kind, value))
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass


class EngineWorker:
    """Runs the engine's decode loop in its own thread; jobs and cancels arrive between steps."""

    def __init__(self, engine: Engine, decoder: str = "pipelined"):
        self.engine, self.decoder = engine, decoder
        self._inbox: queue.Queue[tuple[str, Job | None]] = queue.Queue()
        self._jobs: dict[int, Job] = {}  # engine request id -> its job, until it is delivered
        self._to_forget: list[int] = []  # delivered, record dropped once its pages are back
        self._thread = threading.Thread(target=self._main, name="labkit-engine", daemon=True)
        # set once, under the lock that `submit` holds: after it no job enters the inbox
        self._lock = threading.Lock()
        self.failure: str | None = None  # one line: the loop itself died (every job failed)
        self.closing: str | None = None  # one line: shutting down (every job cancelled)
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "cancelled": 0,
                                         "error": 0}  # by reason

    def start(self) -> EngineWorker:
        """Start the engine thread."""
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the engine thread to finish what it runs, then stop."""
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        """Queue a job (any thread); RuntimeError (one line) if the engine takes no more."""
        with self._lock:
            if self.failure is not None or self.closing is not None:
                raise RuntimeError(self.failure or self.closing)
            self._inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        """Cancel a job at any moment (any thread); a finished one is left alone."""
        self._inbox.put(("cancel", job))

    def shutdown(self, reason: str = "the server is shutting down") -> None:
        """Refuse new jobs; cancel every job that runs or waits, answering each with a 503
        (any thread). The thread itself runs on until `stop`."""
        with self._lock:
            self.closing = reason
        self._inbox.put(("shutdown", None))

    # -- inside the engine thread ----------------------------------------------------------

    def _main(self) -> None:
        engine = self.engine
        engine.on_step = lambda _engine: self._between_steps()
        engine.on_text = self._on_text
        try:
            while True:
                kind, job = self._inbox.get()  # idle: sleep until a request comes
                if not self._apply(kind, job):
                    return
                self._between_steps()
                if not engine.scheduler.idle():
                    run(engine, self.decoder)  # returns once every request has finished
                self._between_steps()
        except BaseException as err:  # noqa: BLE001 - every waiting client is told, then raised
            self._fail(f"the engine failed: {one_line(err)}")
            raise  # the thread's traceback goes to the server's log

    def _fail(self, message: str) -> None:
        """Answer every job, running or still in the inbox, with a 500; refuse new ones."""
        with self._lock:
            self.failure = message
        for job in self._jobs.values():
            job.send("failed", (500, message))
        self._jobs.clear()
        while True:  # the queued ones too: the lock keeps any new job out of the inbox now
            try:
                kind, job = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                job.send("failed", (500, message))

    def _apply(self, kind: str, job: Job | None) -> bool:
        """Carry out one inbox command; False means stop."""
        if kind == "stop":
            return False
        if kind == "shutdown":
            for rid, running in self._jobs.items():
                self.engine.cancel(rid)
                running.send("failed", (503, self.closing))
            return True
        assert job is not None
        if kind == "submit":
            try:
                parent = job.fork_of.request_id if job.fork_of is not None else None
                job.request_id = self.engine.submit(job.prompt_ids, job.params,
                                                    fork_of=parent)
            except (RequestError, ValueError) as err:
                job.send("failed", (400, str(err)))
                return True
            except BaseException as err:  # the engine is broken: this job is answered too
                job.send("failed", (500, f"the engine failed: {one_line(err)}"))
                raise
            self._jobs[job.request_id] = job
        elif kind == "cancel" and job.request_id in self._jobs:
            self.engine.cancel(job.request_id)
        return True

    def _between_steps(self) -> None:
        """Take in new jobs and cancels; deliver what has finished; forget what is released."""
        while True:
            try:
                kind, job = self._inbox.get_nowait()
            except queue.Empty:
                break
            if not self._apply(kind, job):
                self._inbox.put(("stop", None))  # stop once the running requests are done
                break
        engine = self.engine
        for rid in [r for r, j in self._jobs.items() if engine.seqs[r].finalized]:
            job = self._jobs.pop(rid)
            done = engine.completion(rid)
            self.finished["stop" if job.stopped_by_text else done.finish_reason] += 1
            if done.error is not None:  # its commit raised: this request alone failed
                job.send("failed", (500, f"the request failed while generating: {done.error}"))
            else:
                job.send("done", done)
            self._to_forget.append(rid)
        keep = []
        for rid in self._to_forget:
            if engine.seqs[rid].released:
                engine.forget(rid)
            else:
                keep.append(rid)  # a zombie row of a step in flight still holds its pages
        self._to_forget = keep

    def _on_text(self, request_id: int, text: str) -> None:
        job = self._jobs.get(request_id)
        if job is not None:
            job.send("text", text)
