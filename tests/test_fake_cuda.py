"""The CUDA path on a machine without a GPU: labkit's real CudaDevice and DecodeGraphs run on
the fake CUDA of tests/fake_cuda.py (streams, events, graphs that replay the captured ops, and a
sync inside a captured step raises), and the graphed decode step runs on the meta device.

So a GPU machine, lent for minutes, finds no bug a CPU could have found: the cuda-marked tests
of test_decoders.py and test_device_cuda.py run here too, on every `make test`.
"""

import pytest
import torch

from labkit.attention import AttentionMeta
from labkit.device_cuda import decode_step
from labkit.model import LlamaModel, ModelConfig
from labkit.runner import ModelRunner
from labkit.sampling import SamplingBatch, SamplingParams, sample
from tests import fake_cuda
from tests import test_decoders as td
from tests import test_device_cuda as tdc
from tests import test_parallel_sampling as tps
from tests import test_penalties_logprobs as tpl

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and not fake_cuda.STATE.installed,
    reason="a real GPU runs the real cuda tests (scripts/gpu_check.sh)")


@pytest.fixture(scope="module")
def fake():
    with fake_cuda.fake_cuda() as state:
        yield state
        for engines in (td._ENGINES, tpl._ENGINES):  # made here, closed here
            for key in [k for k in engines if k == "cuda"]:
                engines.pop(key).close()


@pytest.fixture(autouse=True)
def _no_capture_errors(fake):
    n = len(fake.capture_errors)
    yield
    assert fake.capture_errors[n:] == [], "a CUDA graph capture failed (the device ran eager)"


# --- the fake itself: what it must catch --------------------------------------------------------

def test_capture_refuses_every_kind_of_sync(fake):
    x = torch.arange(6, device="cuda")
    stream = torch.cuda.Stream()
    for sync in (lambda: x[2].item(), lambda: x.tolist(), lambda: int(x[1]),
                 lambda: x.nonzero(), lambda: x[x > 2], lambda: bool(x[3]),
                 lambda: torch.masked_select(x, x > 1), lambda: x.repeat_interleave(x)):
        with pytest.raises(fake_cuda.HostSync):
            with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
                sync()
    fake.capture_errors.clear()  # those failures were the point


def test_replay_reruns_the_captured_step_on_the_current_inputs(fake):
    buf = torch.zeros(3, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=torch.cuda.Stream()):
        out = (buf + 1) * 2
    buf.copy_(torch.tensor([1.0, 2.0, 3.0]))
    assert out.tolist() == [2.0, 2.0, 2.0]  # nothing ran since the capture
    g.replay()
    assert out.tolist() == [4.0, 6.0, 8.0]


def test_pin_memory_returns_a_copy_and_sync_debug_mode_guards_side_streams(fake):
    host = torch.arange(4)
    pinned = host.pin_memory()
    assert pinned.tolist() == host.tolist() and pinned.data_ptr() != host.data_ptr()
    x = torch.ones(3, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(torch.cuda.Stream()):
            with pytest.raises(fake_cuda.HostSync):
                x.sum().item()
    finally:
        torch.cuda.set_sync_debug_mode(0)


# --- the CUDA device's tests, on the fake ---------------------------------------------------------

def _graphs(fake_state):
    return fake_state.replays


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cuda_decoders_emit_identical_tokens(fake, seed):
    replays = fake.replays
    td.test_decoders_emit_identical_tokens("cuda", seed)
    assert fake.replays > replays, "no decode step ran in a CUDA graph"


def test_cuda_device_agrees_with_the_in_process_one(fake):
    reqs = [r[:3] + (0, None, r[5]) for r in td.workload(5)]
    assert td.run(td.get_engine("cuda"), "pipelined", reqs) == \
        td.run(td.get_engine("inprocess"), "pipelined", reqs)


def test_cuda_constrained_outputs_always_parse(fake):
    td.test_constrained_outputs_always_parse("cuda")


@pytest.mark.parametrize("segment", [1, 3])
def test_cuda_decoders_taking_turns(fake, segment):
    td.test_decoders_taking_turns_emit_the_same_tokens("cuda", segment)


def test_cuda_bfloat16(fake):
    td.test_bfloat16_weights_and_cache_decode_alike_in_both_loops("cuda")


@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_cuda_steady_state_never_syncs(fake, cache):
    tdc.test_steady_state_pipelined_steps_never_sync(cache)


def test_cuda_penalties_and_logprobs(fake):
    # the history staged through pinned memory; the logprobs back in the tokens' copy
    tpl.test_decoders_agree_on_tokens_and_logprobs("cuda")
    tpl.test_tokens_and_logprobs_follow_the_cacheless_model("cuda")


@pytest.mark.parametrize("decoder", ["blocking", "pipelined"])
def test_cuda_parallel_sampling(fake, decoder):
    # copy-on-write before a graph replay, fork rows in eager prefill launches
    tps.test_random_forks_cancels_and_preemptions_keep_every_token("cuda", decoder)


def test_cuda_graphs_off(fake, monkeypatch):
    tdc.test_graphs_off_decode_the_same_tokens(monkeypatch)


def test_cuda_failed_capture_runs_eager(fake, monkeypatch, caplog):
    tdc.test_a_failed_capture_runs_eager_and_logs_once(monkeypatch, caplog)


def test_cuda_full_batch_bucket(fake):
    tdc.test_a_full_batch_is_graphed_in_a_bucket_of_max_seqs()


def test_cuda_close(fake):
    tdc.test_close_frees_graphs_and_masks_and_can_be_called_twice()


def test_cuda_mask_cache(fake):
    tdc.test_mask_cache_is_keyed_by_content_and_bounded()


def test_device_spans_start_after_the_inputs_are_staged(fake, monkeypatch):
    """Host staging (tables, pinned copies) is host time: a span that starts before it books
    host time as device time. The fake's events read the host clock, so the order shows."""
    e = tdc.engine()
    try:
        runner = e.device.runner
        staged = []
        real = runner.to_device

        def to_device(values):
            out = real(values)
            staged.append(fake_cuda.time.perf_counter())
            return out
        monkeypatch.setattr(runner, "to_device", to_device)
        e.device.spans()
        tdc.run_workload(e, "blocking")
        spans = [s for s in e.device.spans() if s[0] == "compute"]
        assert {op for _, op, *_ in spans} == {"forward", "sample"}
        for _, op, step, t0, t1 in spans:
            inside = [t for t in staged if t0 < t < t1]
            assert not inside, f"step {step} {op}: the span began before its inputs were staged"
    finally:
        e.close()


# --- the graphed decode step on the meta device: no value is ever read -------------------------

def test_decode_step_runs_on_the_meta_device():
    """Meta tensors have shapes and no values: any .item(), nonzero or boolean index raises,
    so a decode step that runs here is one a CUDA graph can capture."""
    cfg = ModelConfig.tiny()
    model = LlamaModel(cfg).to("meta").eval()
    runner = ModelRunner(model, num_blocks=9, block_size=8, max_seqs=4, device="meta")
    b, ctx = 4, 64
    rows = torch.zeros(b, dtype=torch.long, device="meta")
    starts = torch.zeros(b, dtype=torch.long, device="meta")
    tables = torch.zeros(b, ctx // 8, dtype=torch.long, device="meta")
    with torch.inference_mode():
        logits = decode_step(runner, rows, starts, tables, ctx)
        assert logits.shape == (b, cfg.vocab_size) and logits.device.type == "meta"
        params = [SamplingParams(temperature=0.7 * (i % 2), top_k=5, top_p=0.9, seed=i)
                  for i in range(b)]
        batch = SamplingBatch.build(params, [1] * b, cfg.vocab_size,
                                    lambda v: torch.tensor(v, device="meta"))
        tokens = sample(logits, batch, torch.ones(b, cfg.vocab_size, dtype=torch.bool,
                                                  device="meta"))
        assert tokens.shape == (b,)


def test_attention_meta_reads_no_length_from_the_device():
    """Off the CPU, max_q and max_ctx must come from the host, and a prefill's packed order
    from host lengths; on the CPU the host lists give the same metadata as the tensors."""
    q, s = torch.tensor([3, 1, 2]), torch.tensor([0, 5, 2])
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]])
    on_meta = tables.to("meta")
    with pytest.raises(ValueError, match="max_q and max_ctx"):
        AttentionMeta.build(q.to("meta"), s.to("meta"), on_meta, 4)
    with pytest.raises(ValueError, match="host_query_lens"):
        AttentionMeta.build(q.to("meta"), s.to("meta"), on_meta, 4, 3, 6)
    meta = AttentionMeta.build(q.to("meta"), s.to("meta"), on_meta, 4, 3, 6,
                               host_query_lens=[3, 1, 2])
    assert meta.write_slots.shape == (6,) and meta.positions.shape == (6,)
    derived = AttentionMeta.build(q, s, tables, 4)
    given = AttentionMeta.build(q, s, tables, 4, 3, 6, host_query_lens=[3, 1, 2],
                                host_starts=[0, 5, 2])
    for name in ("write_slots", "positions", "unpad_index", "mask", "q_index", "last_rows"):
        assert torch.equal(getattr(derived, name), getattr(given, name)), name
    assert given.host_ctx_lens == [3, 6, 4]
