"""`bench step` on the tiny model: every phase is timed and the table is complete."""

import pytest

from labkit.bench import step as bench_step
from tests.bench_helpers import json_rows, refuses


def test_step_rows_have_every_phase(capsys):
    rows, _ = json_rows(bench_step.main, ["--model", "tiny", "--batch", "1,3", "--context", "8",
                                          "--steps", "2", "--json"], capsys)
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert set(r["phases_ms"]) == set(bench_step.PHASES)
        assert r["engine_step_ms"] > 0 and r["bare_forward_ms"] > 0
        assert r["phases_ms"]["kv write + attention"] > 0 and r["phases_ms"]["mlp"] > 0


def test_a_quantized_step_times_its_fused_projections(capsys):
    # a quantized model runs with q|k|v and gate|up fused, and its head is a QuantLinear
    rows, _ = json_rows(bench_step.main, ["--model", "tiny", "--batch", "2", "--context", "8",
                                          "--steps", "2", "--quant", "int8", "--json"], capsys)
    phases = rows[0]["phases_ms"]
    assert phases["qkvo proj"] > 0 and phases["mlp"] > 0 and phases["head"] > 0
    # the C++ forward's kernels by kind: each ran, and together they are its kernels' time
    split = rows[0]["forward_split"]
    if split["stack_served"]:
        kinds = split["kernels_by_kind_ms"]
        assert set(kinds) == {"linears", "attention", "row ops"}
        assert all(ms > 0 for ms in kinds.values()), kinds
        assert sum(kinds.values()) <= split["kernels_ms"] * 1.5  # medians of separate sums


def test_bad_batch_exits_2(capsys, monkeypatch):
    refuses(bench_step.main, ["--batch", "0"], "--batch, --context and --steps must be >= 1",
            capsys, monkeypatch)


def test_bad_quant_exits_2(capsys, monkeypatch):
    refuses(bench_step.main, ["--quant", "int5"], "--quant", capsys, monkeypatch)


@pytest.mark.parametrize("quant", ["int8", "int4", "none"])
def test_a_step_reports_its_linears_read_rate_beside_the_probe(quant, capsys):
    # structure and sanity, not a speed: each of layer 0's linears and the head, then all of a
    # step's linears, with the bytes they read, their time, and the probe's over the same bytes
    from labkit.kernels import cpu as cpu_kernels

    rows, _ = json_rows(bench_step.main, ["--model", "tiny", "--batch", "1,2", "--context", "8",
                                          "--steps", "2", "--quant", quant, "--json"], capsys)
    assert "linear_rates" not in rows[1]  # batch 1 only
    rates = rows[0]["linear_rates"]
    if cpu_kernels.kernels() is None:  # no C++ build: torch's kernels, nothing to probe
        assert rates == []
        return
    names = [r["linear"] for r in rates]
    layer = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # fp32 fused too (fuse=True)
    assert names == [*layer, "lm_head", "step linears"], names  # in the step's order
    step, per_shape = rates[-1], rates[:-1]
    # the step reads every layer's linears and the head once (tiny has 2 layers)
    assert step["shape"] == f"{len(layer) * 2 + 1} linears" and step["bytes"] > sum(
        r["bytes"] for r in per_shape)
    kernels = (["fp32_linear"] if quant == "none"
               else ["int8_linear", "int8_linear_dot", "int4_linear", "int4_linear_dot"])
    for r in rates:
        assert r["kernel"] in kernels, r
        assert r["bytes"] > 0 and r["us"] > 0 and r["probe_us"] > 0 and r["threads"] >= 1, r
        # each figure is its bytes over its time, and the ratio is the probe's time over the
        # kernel's (rounding aside): a table whose columns disagree would mislead
        assert abs(r["gb_per_s"] - r["bytes"] / r["us"] / 1e3) <= 1e-6 * r["gb_per_s"], r
        assert abs(r["over_probe"] - r["probe_us"] / r["us"]) <= 1e-6 * r["over_probe"], r
    head = rates[names.index("lm_head")]
    assert head["shape"] == "8192x64"  # the tiny model's vocabulary by its hidden size
    # the whole forward against its floor: the probe over the step's weight bytes
    floor = rows[0]["forward_floor"]
    assert "forward_floor" not in rows[1] and floor["bytes"] == step["bytes"]
    assert floor["forward_ms"] > 0 and floor["floor_ms"] > 0 and floor["context"] == 8
    assert floor["over_floor"] > 0
    # the DRAM's own rate beside them: a buffer eight times the last-level cache (where sysfs
    # tells it), at least 256 MiB
    dram = rows[0]["dram"]
    assert "dram" not in rows[1] and dram["gb_per_s"] > 0 and dram["bytes"] >= 256 << 20
    assert dram["llc_bytes"] is None or dram["bytes"] >= 8 * dram["llc_bytes"]
    bench_step._table(rows)  # the people's table prints the same rows
    out = capsys.readouterr().out
    assert "read probe" in out and "step linears" in out and "kernel/probe" in out
    assert "x its floor" in out and f"reads {dram['gb_per_s']:.1f} GB/s" in out
    assert f"read {step['gb_per_s'] / dram['gb_per_s']:.2f}x the DRAM's rate" in out


def test_the_step_read_ratio_sampler_gives_the_probe_over_a_pass(monkeypatch):
    # notebook 03's claim samples it: a positive ratio per call (the probe's time over a pass
    # over every linear of a step); None where labkit's kernels do not serve every linear
    import torch

    from labkit.bench import linear_rate
    from labkit.kernels import cpu as cpu_kernels
    from labkit.loading import load_model

    model, _ = load_model("tiny", quant="int4")
    sampler = linear_rate.step_read_ratio(model)
    if cpu_kernels.kernels() is None:
        assert sampler is None
        return
    passes = []
    plain = linear_rate._Pair.one_pass

    def counted(pair):
        passes.append(len(pair.calls))
        plain(pair)

    monkeypatch.setattr(linear_rate._Pair, "one_pass", counted)
    sampler = linear_rate.step_read_ratio(model)
    n = len(passes)  # its warm-up pass
    ratios = [sampler(), sampler(), sampler()]
    assert all(0 < r < 100 for r in ratios), ratios
    # a pass a call, over every linear (tiny: 2 fused layers of 4, the head), from C++
    assert n == 1 and passes == [2 * 4 + 1] * 4
    x, w = torch.randn(1, 8), torch.randn(16, 8)
    with pytest.raises(RuntimeError, match="unknown kind"):
        cpu_kernels.kernels().linear_pass([(99, x, w, w)], 1)
    monkeypatch.setattr(linear_rate, "_kernel", lambda lin: None)
    assert linear_rate.step_read_ratio(model) is None  # a linear labkit does not serve


def test_the_probe_reads_the_weights_own_memory_where_they_lie_together():
    # where load_model placed a model's weights in one buffer, the probe reads those very
    # bytes (a few spans, the gaps between linears read with them and scaled away), so where
    # two buffers of one size lie in memory cannot favour either side; weights in allocations
    # of their own are read as one buffer of their size instead
    import torch

    from labkit.bench import linear_rate
    from labkit.kernels import cpu as cpu_kernels
    from labkit.loading import load_model
    from labkit.utils import pages

    buf = torch.zeros(1 << 20, dtype=torch.uint8)
    a, b, c = buf[:4096], buf[4096 + 64:8192], buf[8192 + (128 << 10):]  # c: past MERGE_GAP
    other = torch.zeros(256, dtype=torch.uint8)
    spans = linear_rate._spans([a, b.view(torch.int16), c, other])
    assert [(s.untyped_storage().data_ptr(), s.storage_offset(), s.numel()) for s in spans] == [
        (buf.untyped_storage().data_ptr(), 0, 8192), (buf.untyped_storage().data_ptr(),
         8192 + (128 << 10), (1 << 20) - 8192 - (128 << 10)), (other.data_ptr(), 0, 256)]
    assert spans[0].data_ptr() == a.data_ptr()  # views of the same memory, not copies
    if cpu_kernels.kernels() is None:
        return
    model, _ = load_model("tiny", quant="int4", fuse=True)
    first, order = linear_rate._step_linears(model)
    apart = linear_rate._Pair(order)  # tiny's weights are too few to place: allocations apart
    assert apart.probe == "a buffer of the same bytes" and apart.read_scale == 1.0
    if pages.huge_pages() is not None:  # no 2 MiB pages here: place_weights moves nothing
        return
    pages.place_weights(model, min_bytes=0)
    pair = linear_rate._Pair(order)
    assert pair.probe.startswith("the weights' own memory") and len(pair.spans) <= 2
    weights = [t for _, _, a, b in pair.calls for t in (a, b) if t.numel()]
    lo = min(s.data_ptr() for s in pair.spans)
    hi = max(s.data_ptr() + s.numel() for s in pair.spans)
    assert all(lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi
               for t in weights)  # every weight inside what the probe reads
    assert 0.9 < pair.read_scale <= 1.0  # the spans hold the weights and a little besides


def test_the_last_level_cache_is_read_from_sysfs(tmp_path, monkeypatch):
    from labkit.bench import linear_rate

    for name, size in (("index0", "48K"), ("index2", "1024K"), ("index3", "32768K")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "size").write_text(size + "\n")
    monkeypatch.setattr(linear_rate, "_CACHES", tmp_path)
    assert linear_rate.last_level_cache() == 32 << 20
    monkeypatch.setattr(linear_rate, "_CACHES", tmp_path / "absent")
    assert linear_rate.last_level_cache() is None
