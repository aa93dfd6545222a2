"""The answers to one HTTP request, one choice per prompt, as the engine's events arrive.

The engine thread (`labkit.serving.worker`) sends each job's pieces of text, then its completion
or its failure; `Choices` is where the HTTP side takes them in. Each choice's text passes
through its stop strings (`labkit.stop_text`): a tail that could still grow into a stop string
is held back until it cannot, and a stop string met ends that choice's text just before it and
cancels its job in the engine. A failure of one prompt cancels the request's others.
"""

from __future__ import annotations

from typing import Any

from labkit.engine import Completion
from labkit.serving.worker import EngineWorker, Job
from labkit.stop_text import StopText


class Choices:
    """The answers to one HTTP request, one per prompt, as the engine's events arrive. Each
    choice's text goes through its stop strings; a stop string cancels that choice's job."""

    def __init__(self, worker: EngineWorker, jobs: list[Job], stops: list[str]):
        self.worker, self.jobs, self.events = worker, jobs, jobs[0].events
        self.cutters = [StopText(stops) for _ in jobs]
        self.texts: list[list[str]] = [[] for _ in jobs]
        self.done: list[Completion | None] = [None] * len(jobs)
        self.failure: tuple[int, str] | None = None  # (http status, message)

    @property
    def over(self) -> bool:
        """Every choice is done, or one failed (and the others were cancelled)."""
        return self.failure is not None or all(d is not None for d in self.done)

    def take(self, index: int, kind: str, value: Any) -> str:
        """Apply one event; returns the text it releases for choice `index` ("" if none)."""
        if kind == "failed":
            self.failure = value
            self.cancel()  # the request's other prompts
            return ""
        cutter, job = self.cutters[index], self.jobs[index]
        if kind == "text":
            text, stopped = cutter.push(value)
            if stopped and not job.stopped_by_text:
                job.stopped_by_text = True
                self.worker.cancel(job)  # the engine stops it at its next step
        else:  # done
            text = cutter.flush()
            self.done[index] = value
        self.texts[index].append(text)
        return text

    def finish_reason(self, index: int) -> str:
        """OpenAI's finish reason of a done choice: "length", or "stop" (EOS, a stop string)."""
        if self.jobs[index].stopped_by_text:
            return "stop"
        done = self.done[index]
        return "length" if done is not None and done.finish_reason == "length" else "stop"

    def cancel(self) -> None:
        """Cancel every choice that has not finished (its client left, a sibling failed)."""
        for job, done in zip(self.jobs, self.done):
            if done is None:
                self.worker.cancel(job)

    def usage(self) -> dict:
        """The token counts, summed over the choices (a prompt counted once, not per sample:
        its forks shared its computation)."""
        n_in = sum(len(c.prompt_ids) for c, job in zip(self.done, self.jobs)
                   if c is not None and job.fork_of is None)
        n_out = sum(len(c.output_ids) for c in self.done if c is not None)
        return {"prompt_tokens": n_in, "completion_tokens": n_out,
                "total_tokens": n_in + n_out}
