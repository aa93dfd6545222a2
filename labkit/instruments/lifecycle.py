"""A request's life, event by event: what every launch and commit did to every sequence.

A `Lifecycle` watches an engine while a decoder runs. After each step piece the decoder calls
(launch, finish_sampling, wait_tokens, commit) it logs an `Event`, and after each launch and
commit it snapshots every sequence: running, zombie (finalized, still referenced), released, and
its `inflight_refs`. The pipelined loop's defining moment shows up here: right after launch t+1
and before commit t, a sequence is in two launched steps (refs = 2).

    with Lifecycle.record(engine) as life:
        run(engine, "pipelined")
    life.released_at(request_id); life.plot()

It wraps the engine's methods on the instance only, for the duration of the block: the engine
itself knows nothing about it (the graders of chapter 07 use it to observe a learner's loop).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

PIECES = ("launch", "finish_sampling", "wait_tokens", "commit")


@dataclass(frozen=True)
class Event:
    """One step piece the decoder called: its name, the launch's step and slot."""

    piece: str  # one of PIECES
    step: int
    slot: int


@dataclass(frozen=True)
class SeqState:
    """A sequence as one snapshot saw it."""

    request_id: int
    state: str  # "waiting", "running", "zombie" (finalized, pages held) or "released"
    refs: int  # inflight_refs
    tokens: int  # len(output_ids)


@dataclass(frozen=True)
class Snapshot:
    """Every watched sequence right after one launch or commit."""

    piece: str  # "launch" or "commit"
    step: int
    free_pages: int
    seqs: tuple[SeqState, ...]


def seq_state(seq) -> str:
    """The lifecycle state of a labkit Sequence."""
    if seq.released:
        return "released"
    if seq.finalized:
        return "zombie"
    return "waiting" if seq.status.value == "waiting" else "running"


@dataclass
class Lifecycle:
    """The events and snapshots of one recorded run."""

    events: list[Event] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)

    @staticmethod
    @contextlib.contextmanager
    def record(engine):
        """Log every step piece the decoder calls on `engine` during the block."""
        life = Lifecycle()
        originals = {name: getattr(engine, name) for name in PIECES}
        shadowed = {name: vars(engine)[name] for name in PIECES if name in vars(engine)}

        def wrap(name):
            original = originals[name]

            def piece(launch, *args, **kwargs):
                out = original(launch, *args, **kwargs)
                life.events.append(Event(name, launch.plan.step, launch.slot))
                if name in ("launch", "commit"):
                    life.snapshots.append(Snapshot(
                        name, launch.plan.step, engine.scheduler.allocator.num_free,
                        tuple(SeqState(s.request_id, seq_state(s), s.inflight_refs,
                                       len(s.output_ids)) for s in engine.seqs.values())))
                return out
            return piece

        for name in PIECES:  # instance attributes shadow the methods for this block only
            setattr(engine, name, wrap(name))
        try:
            yield life
        finally:
            for name in PIECES:  # put back what was there: a method, or another wrapper
                if name in shadowed:
                    setattr(engine, name, shadowed[name])
                else:
                    delattr(engine, name)

    def at(self, piece: str, request_id: int, state: str) -> int | None:
        """The step whose `piece` ("launch"/"commit") first left the request in `state`."""
        for snap in self.snapshots:
            if snap.piece == piece and any(s.request_id == request_id and s.state == state
                                           for s in snap.seqs):
                return snap.step
        return None

    def finalized_at(self, request_id: int) -> int | None:
        """The step whose commit ended the request (it became a zombie, or was released)."""
        for snap in self.snapshots:
            for s in snap.seqs:
                if s.request_id == request_id and s.state in ("zombie", "released"):
                    return snap.step if snap.piece == "commit" else None
        return None

    def released_at(self, request_id: int) -> int | None:
        """The step whose commit gave the request's pages back."""
        return self.at("commit", request_id, "released")

    def max_refs(self, request_id: int) -> int:
        """The most launched steps that referenced the request at once."""
        return max((s.refs for snap in self.snapshots for s in snap.seqs
                    if s.request_id == request_id), default=0)

    def plot(self, ax=None, title: str = ""):
        """One row per request, one column per launch or commit: running, zombie, released,
        with each cell's inflight_refs written in it; returns the axes."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(11, 2.4))
        colors = {"waiting": "whitesmoke", "running": "tab:blue", "zombie": "tab:red",
                  "released": "lightgray"}
        ids = sorted({s.request_id for snap in self.snapshots for s in snap.seqs})
        for x, snap in enumerate(self.snapshots):
            for s in snap.seqs:
                y = ids.index(s.request_id)
                ax.barh(y, 1, left=x, height=0.8, color=colors[s.state], edgecolor="white")
                if s.state in ("running", "zombie"):
                    ax.text(x + 0.5, y, str(s.refs), ha="center", va="center", fontsize=7,
                            color="white", fontweight="bold" if s.refs > 1 else "normal")
        ax.set_yticks(range(len(ids)), [f"request {i}" for i in ids])
        ax.set_xticks([x + 0.5 for x in range(len(self.snapshots))],
                      [f"{'L' if s.piece == 'launch' else 'C'}{s.step}" for s in self.snapshots],
                      fontsize=7)
        ax.set_xlabel("after launch (L) or commit (C) of step; the number in a cell is "
                      "inflight_refs")
        ax.set_xlim(0, len(self.snapshots))
        ax.invert_yaxis()
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
        ax.legend(handles, list(colors), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
        ax.set_title(title, fontsize=9, loc="left")
        return ax
