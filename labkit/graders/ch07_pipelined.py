"""Chapter 07's graders: the zombie rules (commit_row, can_release) and the pipelined loop, run on
the engine.
"""

from __future__ import annotations

from collections.abc import Callable

from labkit.graders.common import tiny_model


def _seq(**fields):
    """A sequence-like object holding only the fields the chapter-07 rules read and write."""
    from types import SimpleNamespace

    state = {"finalized": False, "inflight_refs": 0, "released": False, "output_ids": [],
             "zombie_rows": 0}
    state.update(fields)
    return SimpleNamespace(**state)


LENGTHS = (2, 4, 7)  # max_new_tokens of the requests the engine-level graders run


def _engine_run(loop: Callable, lengths=LENGTHS, commit_row: Callable | None = None,
                max_launches: int = 200):
    """Run `loop(engine)` on the tiny random model (in-process device) over requests of
    `lengths` new tokens each, recording their lifecycle; with `commit_row`, the engine's
    commit uses it in place of labkit's. Returns (engine, request ids, lifecycle, error)."""
    from labkit import engine as engine_module
    from labkit.engine import Engine
    from labkit.instruments.lifecycle import Lifecycle
    from labkit.sampling import SamplingParams

    eng = Engine(tiny_model(), None, device="inprocess", kv_tokens=1024, block_size=4,
                 max_seqs=8)
    ids = [eng.submit([3 + i, 17, 29 + i, 40], SamplingParams(
        max_new_tokens=n, ignore_eos=True, temperature=0.8 * (i % 2), seed=7 + i))
        for i, n in enumerate(lengths)]
    original = engine_module.commit_row
    error = None
    count = [0]
    launch = eng.launch

    def counted(launched, slot):  # a loop that never ends is a wrong answer, not a hang
        count[0] += 1
        if count[0] > max_launches:
            raise RuntimeError(f"more than {max_launches} launches for requests of {lengths} "
                               "tokens: the loop does not finish")
        launch(launched, slot)

    eng.launch = counted
    if commit_row is not None:
        engine_module.commit_row = commit_row
    try:
        with Lifecycle.record(eng) as life:
            loop(eng)
    except NotImplementedError:
        raise
    except Exception as err:  # the engine's own checks (a page freed twice, ...) or a hang
        error = f"{type(err).__name__}: {err}"
    finally:
        engine_module.commit_row = original
        del eng.launch
    return eng, ids, life, error


def _blocking_tokens(lengths=LENGTHS) -> list[list[int]]:
    """labkit's blocking loop on the same requests: the tokens any correct loop must give."""
    from labkit.decode_blocking import run_blocking

    eng, ids, _, error = _engine_run(run_blocking, lengths)
    assert error is None, error
    return [eng.seqs[i].output_ids for i in ids]


def grade_commit_row(fn: Callable) -> str:
    """Grade an answer to exercise `commit_row` (exercises/ch07_pipelined.py)."""
    # a zombie: finalized at commit t (EOS = 2 appended), still a row of step t+1
    z = _seq(finalized=True, inflight_refs=1, output_ids=[11, 12, 2])
    got = fn(z, 99)
    if z.output_ids != [11, 12, 2]:
        raise AssertionError(
            f"commit_row: a zombie row appended a token (output_ids became {z.output_ids}): a "
            "sequence finalized at commit t must not grow at commit t+1. When `finalized` is "
            "set, append nothing")
    if z.inflight_refs != 0:
        raise AssertionError(
            f"commit_row: a zombie row left inflight_refs at {z.inflight_refs} (it was 1): the "
            "committed step no longer references the sequence, zombie or not. Without the "
            "decrement `finalized and inflight_refs == 0` never holds and its KV pages leak")
    if z.zombie_rows != 1:
        raise AssertionError(
            f"commit_row: a zombie row left zombie_rows at {z.zombie_rows}, expected 1: count "
            "every skipped row (the zombie tax is measured and reported, not hidden)")
    if got is not False:
        raise AssertionError(f"commit_row: returned {got!r} for a skipped zombie row; return "
                             "False when nothing was appended")
    # a live row: one launched step is committed
    s = _seq(inflight_refs=1, output_ids=[11, 12])
    got = fn(s, 13)
    if s.output_ids != [11, 12, 13]:
        raise AssertionError(f"commit_row: a live row made output_ids {s.output_ids}, expected "
                             "[11, 12, 13]: an unfinished sequence appends the row's token")
    if s.inflight_refs != 0:
        raise AssertionError(f"commit_row: a live row left inflight_refs at {s.inflight_refs}, "
                             "expected 0 (it was 1): every committed row drops one reference")
    if s.zombie_rows != 0:
        raise AssertionError("commit_row: a live row was counted as a zombie")
    if got is not True:
        raise AssertionError(f"commit_row: returned {got!r} for an appended row, expected True")
    for case in (z, s):
        if case.finalized != (case is z):
            raise AssertionError("commit_row changed `finalized`: deciding that a sequence "
                                 "ends is the caller's job (after a True), not the row rule's")
    # the pipelined order: launch t, launch t+1 (refs 2), commit t ends it, commit t+1
    p = _seq(inflight_refs=2, output_ids=[5])
    first = fn(p, 2)  # commit t: EOS; the caller sees it and finalizes
    if p.inflight_refs != 1:
        raise AssertionError(
            f"commit_row: committing step t of a sequence that steps t and t+1 both reference "
            f"(inflight_refs 2) left inflight_refs at {p.inflight_refs}, expected 1. Subtract "
            "one per committed row; setting it to 0 frees the pages while step t+1, in flight, "
            "still writes them (chapter 07's central bug)")
    p.finalized = True
    second = fn(p, 7)  # commit t+1: the zombie row
    state = (first, second, p.output_ids, p.inflight_refs, p.zombie_rows)
    if state != (True, False, [5, 2], 0, 1):
        raise AssertionError(
            "commit_row in the pipelined order (launch t, launch t+1, commit t ends the "
            "sequence, commit t+1): expected (True, False, output_ids [5, 2], inflight_refs 0, "
            f"zombie_rows 1), got {state}")
    # cancelled with two steps in flight: two zombie rows, each counted
    c = _seq(finalized=True, inflight_refs=2, output_ids=[4])
    fn(c, 8)
    fn(c, 9)
    if (c.zombie_rows, c.inflight_refs) != (2, 0):
        raise AssertionError(
            "commit_row: a sequence cancelled while two launched steps reference it has two "
            f"zombie rows; after both commits zombie_rows is {c.zombie_rows} and inflight_refs "
            f"{c.inflight_refs}, expected 2 and 0. Add one to zombie_rows per skipped row "
            "(`+= 1`, not `= 1`)")
    # a row committed with no reference outstanding is a bookkeeping bug: it must show
    b = _seq(inflight_refs=0, output_ids=[4])
    try:
        fn(b, 8)
    except Exception:  # raising is an honest answer too
        pass
    else:
        if b.inflight_refs != -1:
            raise AssertionError(
                f"commit_row: a row of a sequence with inflight_refs 0 left it at "
                f"{b.inflight_refs}, expected -1 (or an error). A commit with no reference "
                "outstanding means a step was counted wrong; clamping at 0 (max(0, ...)) hides "
                "that bug, while -1 keeps the pages from being released and "
                "check_all_released reports it")
    # and inside the engine: the pages come back exactly at the commit of the zombie row
    from labkit.decoders import run

    eng, ids, life, error = _engine_run(lambda e: run(e, "pipelined"), commit_row=fn)
    if error is not None:
        raise AssertionError(f"commit_row inside the engine (pipelined, requests of {LENGTHS} "
                             f"tokens): {error}")
    for rid, n in zip(ids, LENGTHS):
        seq = eng.seqs[rid]
        ended, back = life.finalized_at(rid), life.released_at(rid)
        if len(seq.output_ids) != n:
            raise AssertionError(f"commit_row inside the engine: request {rid} (max_new_tokens "
                                 f"{n}) ended with {len(seq.output_ids)} tokens")
        if back != (None if ended is None else ended + 1):
            where = ("never" if back is None else f"at the commit of step {back}")
            raise AssertionError(
                f"commit_row inside the engine: request {rid} ended at the commit of step "
                f"{ended}, and its pages came back {where}; expected at the commit of step "
                f"{None if ended is None else ended + 1}, its zombie row (step {ended} + 1 was "
                "launched before commit {ended} and still writes its KV pages)".replace(
                    "{ended}", str(ended)))
    eng.check_all_released()
    return ("zombie rows skipped and counted, one reference per row; in the engine every "
            "request's pages came back at its zombie row's commit")


def grade_can_release(fn: Callable) -> str:
    """Grade an answer to exercise `can_release` (exercises/ch07_pipelined.py)."""
    cases = [  # (finalized, inflight_refs, released, expected, the rule a wrong answer breaks)
        (True, 1, False, False,
         "its zombie row is still in flight: that step writes the sequence's KV pages, and a new "
         "request's prefill could already have been given them"),
        (True, 0, False, True,
         "finalized and no launched step references it: release now, or its KV pages leak and "
         "admission stalls"),
        (False, 0, False, False,
         "it is not finalized: it will be launched again and write into pages that are free"),
        (True, 0, True, False,
         "it was released already: releasing twice puts the same pages in the free list twice, "
         "and two requests end up sharing them"),
        (True, 2, False, False, "two launched steps still reference it"),
        (False, 1, False, False, "it is running, with a step in flight"),
        (True, 1, True, False, "it was released already (and is still referenced)"),
        (False, 0, True, False, "it was released already"),
    ]
    for finalized, refs, released, want, rule in cases:
        s = _seq(finalized=finalized, inflight_refs=refs, released=released)
        before = dict(vars(s))
        got = fn(s)
        if vars(s) != before:
            raise AssertionError(f"can_release modified the sequence ({before} -> {vars(s)}): "
                                 "the rule only answers; Scheduler.release_if_done acts on it")
        if not isinstance(got, bool):
            raise AssertionError(f"can_release returned {got!r} ({type(got).__name__}); "
                                 "return a bool")
        if got != want:
            raise AssertionError(
                f"can_release(finalized={finalized}, inflight_refs={refs}, released={released}) "
                f"returned {got}, expected {want}: {rule}")
    return f"releases only when finalized, unreferenced and not yet released ({len(cases)} cases)"


def _check_order(events) -> None:
    """Raise unless the events are a pipelined schedule: see `grade_run_pipelined`."""
    seen: dict[int, list[str]] = {}
    in_flight: dict[int, int] = {}  # launched, uncommitted step -> its slot
    prev = None  # the step launched before the latest one
    last = None
    for ev in events:
        pieces = seen.setdefault(ev.step, [])
        want_next = ("launch", "finish_sampling", "wait_tokens", "commit")[len(pieces)] \
            if len(pieces) < 4 else None
        if ev.piece != want_next:
            raise AssertionError(
                f"step {ev.step}: {ev.piece} called after {pieces or 'nothing'}; each step goes "
                "launch -> finish_sampling -> wait_tokens -> commit, once each")
        pieces.append(ev.piece)
        if ev.piece == "launch":
            holder = [s for s, slot in in_flight.items() if slot == ev.slot]
            if holder:
                raise AssertionError(
                    f"step {ev.step} was launched into slot {ev.slot} while step {holder[0]}, "
                    "still uncommitted, holds it: alternate the two slots (1 - prev.slot)")
            in_flight[ev.step] = ev.slot
            prev, last = last, ev.step
            if prev is not None and "wait_tokens" in seen[prev]:
                raise AssertionError(
                    f"step {ev.step} was launched after step {prev}'s tokens were read "
                    "(wait_tokens): that is the blocking loop, and the device idles while the "
                    f"host commits. Launch step t+1 first, then commit step t")
        elif ev.piece == "finish_sampling" and prev is not None and ev.step == last \
                and "commit" not in seen[prev]:
            raise AssertionError(
                f"step {ev.step} was sampled (finish_sampling) before step {prev} was committed: "
                f"constrained rows of step {ev.step} need masks from the state commit {prev} "
                "produces. Order: launch t+1, commit t, then finish sampling t+1")
        elif ev.piece == "commit":
            in_flight.pop(ev.step)
    unfinished = {s: p for s, p in seen.items() if len(p) < 4}
    if unfinished:
        step, pieces = min(unfinished.items())
        raise AssertionError(f"step {step} was launched but never committed (it got only "
                             f"{pieces}): commit the last step in flight before returning")


def grade_run_pipelined(fn: Callable) -> str:
    """Grade an answer to exercise `run_pipelined` (exercises/ch07_pipelined.py)."""
    lengths = (2, 4, 7, 5)
    want = _blocking_tokens(lengths)
    eng, ids, life, error = _engine_run(fn, lengths)
    if error is not None:
        raise AssertionError(f"run_pipelined on requests of {lengths} tokens: {error}")
    if not life.events:
        raise AssertionError("run_pipelined launched nothing")
    _check_order(life.events)
    got = [eng.seqs[i].output_ids for i in ids]
    if got != want:
        bad = next(i for i in range(len(ids)) if got[i] != want[i])
        raise AssertionError(f"run_pipelined: request {ids[bad]} decoded {got[bad]}, the "
                             f"blocking loop {want[bad]}: a pipeline must not change the tokens")
    for rid in ids:
        ended, back = life.finalized_at(rid), life.released_at(rid)
        if ended is None or back != ended + 1:
            raise AssertionError(
                f"run_pipelined: request {rid} ended at the commit of step {ended}, its pages "
                f"came back at the commit of step {back}; with step t+1 launched before commit "
                "t they come back one commit later, at its zombie row (finalized and refs == 0)")
    if max(life.max_refs(rid) for rid in ids) < 2:
        raise AssertionError("run_pipelined: no sequence was ever in two launched steps at "
                             "once (inflight_refs 2): nothing overlapped")
    eng.check_all_released()
    return ("same tokens as blocking; step t+1 launched before step t's tokens were read, into "
            "the other slot; sampled after commit t; pages back at the zombie row's commit")
