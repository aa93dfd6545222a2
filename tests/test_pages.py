"""labkit.utils.pages: a model's weights copied into buffers on 2 MiB pages change no output,
keep what models share shared (and never keep another model's buffer for a part of it), and
are left as they are, with the reason, where huge pages cannot be had."""

from __future__ import annotations

import pytest
import torch

from labkit.bench.paths import weight_pages
from labkit.kernels import stack as decoder_stack
from labkit.model import LlamaModel, ModelConfig, init_random
from labkit.quant import quantize_model
from labkit.utils import pages

needs_thp = pytest.mark.skipif(pages.huge_pages() is not None,
                               reason=f"no huge pages here: {pages.huge_pages()}")


def _model(quant: str | None = None, fuse: bool = False, seed: int = 3) -> LlamaModel:
    model = init_random(LlamaModel(ModelConfig.tiny()).eval(), seed=seed).requires_grad_(False)
    if quant is not None:
        model = quantize_model(model, quant)
    if fuse:
        model.fuse_projections()
    return model


def _logits(model) -> list[torch.Tensor]:
    """Two steps of two sequences through the paged attention (the decoder stack where labkit's
    kernels serve, the Python layers elsewhere)."""
    from labkit.attention import BACKENDS
    from labkit.paged_kv import PagedKVCache

    cache = PagedKVCache(model.cfg, 16, 4, torch.float32)
    attn = BACKENDS["paged"](cache)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    gen = torch.Generator().manual_seed(0)
    lens, starts, out = torch.tensor([5, 7]), torch.tensor([0, 0]), []
    for _ in range(2):
        ids = torch.randint(0, model.cfg.vocab_size, (int(lens.sum()),), generator=gen)
        meta = type(attn).meta_type.build(lens, starts, tables, 4)
        attn.begin_step(meta)
        out.append(model(ids, meta.positions, attn, logit_rows=meta.last_rows))
        starts, lens = starts + lens, torch.tensor([1, 1])
    return out


def _ptrs(model) -> list[int]:
    return [t.data_ptr() for t in pages._tensors(model)]


@needs_thp
@pytest.mark.parametrize(("quant", "fuse"), [(None, False), (None, True), ("int8", True),
                                             ("int4-g32", True)])
def test_placed_weights_give_the_same_logits_bit_for_bit(quant, fuse):
    model = _model(quant, fuse)
    want = _logits(model)
    before = pages.placement(model)
    assert before["placed"] == 0 and before["bytes"] > 0
    done = pages.place_weights(model, min_bytes=0)
    assert done["skipped"] is None and done["moved"] >= done["bytes"] == before["bytes"]
    assert done["placed"] == done["bytes"]
    got = _logits(model)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # one buffer (the tiny model has no tensor of LARGE bytes), in the model's order
    tensors = pages._tensors(model)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    ptrs = _ptrs(model)
    assert ptrs == sorted(ptrs) and all(p % pages.ALIGN == 0 for p in ptrs)


@needs_thp
def test_a_layer_stack_built_before_is_rebuilt_from_the_moved_weights():
    model = _model("int4-g32", True)
    want = _logits(model)  # builds the decoder stack (where the kernels serve)
    pages.place_weights(model, min_bytes=0)
    assert model not in decoder_stack._STACKS  # forgotten: it held the old tensors
    for g, w in zip(_logits(model), want):
        assert torch.equal(g, w)


@needs_thp
def test_a_shared_parameter_moves_for_every_holder_and_placing_again_moves_nothing():
    model = _model()
    other = torch.nn.Linear(1, 1)
    other.weight = model.layers[0].down_proj.weight  # the same Parameter object
    pages.place_weights(model, min_bytes=0)
    assert other.weight.data_ptr() == model.layers[0].down_proj.weight.data_ptr()
    assert pages._placed(other.weight) is not None
    ptrs = _ptrs(model)
    again = pages.place_weights(model, min_bytes=0)
    assert again["moved"] == 0 and again["skipped"] == "every weight placed before"
    assert _ptrs(model) == ptrs


@needs_thp
def test_a_model_holding_part_of_another_models_buffer_gets_its_own_copy():
    fp32 = _model()
    pages.place_weights(fp32, min_bytes=0)
    shared_norm = fp32.layers[0].input_norm
    # a second model sharing the first one's Parameters (as two loads of one GGUF do), then
    # fused: it keeps only part of the first model's buffer (norms, o_proj, down_proj, ...)
    second = LlamaModel(fp32.cfg).eval()
    second.load_state_dict(dict(fp32.named_parameters()), assign=True)
    second.requires_grad_(False)
    assert second.layers[0].input_norm is shared_norm
    want = _logits(fp32)
    second.fuse_projections()
    done = pages.place_weights(second, min_bytes=0)
    assert done["placed"] == done["bytes"]
    mine = second.layers[0].input_norm
    assert mine is not shared_norm and torch.equal(mine, shared_norm)  # a copy of its own
    assert mine.untyped_storage().data_ptr() != shared_norm.untyped_storage().data_ptr()
    firsts = {t.untyped_storage().data_ptr() for t in pages._tensors(fp32)}
    assert not firsts & {t.untyped_storage().data_ptr() for t in pages._tensors(second)}
    assert fp32.layers[0].input_norm is shared_norm  # the first model untouched
    for g, w in zip(_logits(fp32), want):
        assert torch.equal(g, w)
    for g, w in zip(_logits(second), want):  # fusing changes no output bits (batch-invariant)
        assert torch.equal(g, w)


@needs_thp
def test_a_large_tensor_gets_a_buffer_of_its_own_and_stays_shared(monkeypatch):
    monkeypatch.setattr(pages, "LARGE", 64 * 1024)  # the tiny model's embedding is 1 MiB
    fp32 = _model()
    pages.place_weights(fp32, min_bytes=0)
    embed = fp32.embed.weight
    assert embed.untyped_storage().nbytes() < 2 * embed.numel() * 4 + 4 * pages.HUGE
    second = LlamaModel(fp32.cfg).eval()
    second.load_state_dict(dict(fp32.named_parameters()), assign=True)
    second.fuse_projections()
    pages.place_weights(second, min_bytes=0)
    assert second.embed.weight is embed  # its whole buffer is held: shared, not copied


@needs_thp
def test_empty_asks_the_kernel_for_huge_pages():
    t = pages.empty(8 << 20)
    assert t.numel() == 8 << 20 and t.dtype == torch.uint8
    assert t.data_ptr() % pages.HUGE == 0
    t.fill_(1)
    assert pages.huge_eligible(t)
    if "[madvise]" in pages._SETTING.read_text():  # only what is asked for gets them
        # (64 MiB: above glibc's largest mmap threshold, so mapped afresh; a smaller block can
        # reuse heap memory that an earlier `empty` asked huge pages for, and keeps that flag)
        plain = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
        assert not pages.huge_eligible(plain)


@needs_thp
def test_small_pages_are_small_even_where_huge_ones_were_asked_for_before():
    # heap memory that an earlier empty() asked 2 MiB pages for keeps asking, for its next
    # tenant too: a 4 KiB buffer must say no itself
    for _ in range(3):
        big = pages.empty(4 << 20).fill_(1)
        assert pages.huge_eligible(big)
        del big
        t = pages.empty(4 << 20, huge=False).fill_(1)
        assert t.numel() == 4 << 20 and not pages.huge_eligible(t) and pages.huge_bytes(t) == 0


@needs_thp
def test_the_kv_pool_lies_in_huge_pages_and_starts_empty():
    # decode reads a token's keys a few hundred bytes at a time, scattered through the pool
    from labkit.paged_kv import PagedKVCache
    cfg = ModelConfig.smollm2_135m()
    cache = PagedKVCache(cfg, num_blocks=64, block_size=16, dtype=torch.bfloat16)  # 2 x 11 MiB
    for t in (cache.k, cache.v):
        assert t.shape == (cfg.num_layers, 64 * 16, cfg.num_kv_heads, cfg.head_dim)
        assert t.dtype == torch.bfloat16 and t.is_contiguous() and not t.any()
        assert t.data_ptr() % pages.HUGE == 0 and pages.huge_eligible(t)
    cache.pool(3)[0][5, 2].fill_(1.0)  # a page of one layer, through the views
    assert int(cache.k[3].ne(0).sum()) == cfg.num_kv_heads * cfg.head_dim
    small = PagedKVCache(ModelConfig.tiny(), num_blocks=4, block_size=4)  # under 2 MiB: plain
    assert not small.k.any() and small.k.dtype == torch.float32


def test_without_huge_pages_nothing_moves_and_the_reason_is_said(monkeypatch, tmp_path):
    model = _model()
    ptrs = _ptrs(model)
    monkeypatch.setenv("LABKIT_HUGE_PAGES", "0")
    done = pages.place_weights(model, min_bytes=0)
    assert done["skipped"] == "LABKIT_HUGE_PAGES=0" and done["moved"] == 0
    assert _ptrs(model) == ptrs
    assert "LABKIT_HUGE_PAGES=0" in weight_pages(model)
    assert pages.empty(4 << 20).numel() == 4 << 20  # a plain allocation still
    monkeypatch.delenv("LABKIT_HUGE_PAGES")
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(pages, "_SETTING", setting)
    assert "off" in pages.huge_pages()
    assert pages.place_weights(model, min_bytes=0)["skipped"].startswith("the kernel's")
    monkeypatch.setattr(pages, "_SETTING", tmp_path / "absent")
    assert "not readable" in pages.huge_pages()
    assert _ptrs(model) == ptrs


@needs_thp
def test_a_model_under_the_threshold_is_left_as_it_is():
    model = _model()
    ptrs = _ptrs(model)
    done = pages.place_weights(model)  # the tiny model: ~2 MiB, under MIN_BYTES
    assert "below 32 MiB" in done["skipped"] and _ptrs(model) == ptrs
    assert "under 32 MiB" in weight_pages(model)


@needs_thp
def test_placed_weights_can_still_be_shared_with_a_device_process():
    model = _model("int4-g32", True)
    want = _logits(model)
    pages.place_weights(model, min_bytes=0)
    model.share_memory()  # what labkit.device does before handing the model over
    assert all(t.is_shared() for t in pages._tensors(model))
    for g, w in zip(_logits(model), want):
        assert torch.equal(g, w)


@needs_thp
def test_load_model_places_smollm2_in_huge_pages_in_the_steps_order():
    from labkit.loading import load_model

    model, _ = load_model("smollm2-135m", quant="int4")
    where = pages.placement(model)
    assert where["placed"] == where["bytes"] > 80e6
    layer = model.layers[3]
    order = [layer.qkv_proj.kweight, layer.o_proj.kweight,
             layer.gate_up_proj.kweight, layer.down_proj.kweight]
    assert [t.data_ptr() for t in order] == sorted(t.data_ptr() for t in order)
    assert pages.huge_eligible(layer.down_proj.kweight)
    assert "in 2 MiB pages" in weight_pages(model)


@needs_thp
def test_a_deep_copy_of_a_placed_model_is_not_taken_for_placed():
    import copy

    model = _model()
    pages.place_weights(model, min_bytes=0)
    twin = copy.deepcopy(model)  # its tensors carry the mark, in memory of their own
    assert pages.placement(twin)["placed"] == 0
    done = pages.place_weights(twin, min_bytes=0)
    assert done["moved"] > 0 and done["placed"] == done["bytes"]
    assert pages.placement(model)["placed"] == pages.placement(model)["bytes"]  # untouched


@needs_thp
def test_a_setups_quantized_copy_is_placed(monkeypatch):
    from labkit.whole_engine import EngineSetup

    monkeypatch.setattr(pages, "MIN_BYTES", 0)  # the tiny model is ~2 MiB

    fp32 = _model()
    cache: dict = {}
    EngineSetup.whole().build(fp32, None, quantized=cache, kv_tokens=64)
    (copy_,) = cache.values()
    where = pages.placement(copy_)
    assert where["placed"] == where["bytes"] > 0


class _Probe:
    """A stand-in for labkit's kernels that records which buffer each read_probe call read."""

    def __init__(self):
        self.reads: list[int] = []

    def read_probe(self, buf):
        self.reads.append(buf.data_ptr())


def test_read_gain_reads_every_buffer_alike_forth_then_back(monkeypatch):
    from labkit.bench import pages as bench_pages
    from labkit.kernels import cpu as cpu_kernels

    probe = _Probe()
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: probe)
    got = bench_pages.read_gain(1 << 20, buffers=4, reads=2, n=3, control=True)
    assert len(got.gain.samples) == 3 and set(got.rates) == {"4 KiB", "2 MiB"}
    turn = probe.reads[:len(probe.reads) // 3]
    assert len(turn) == 2 * 8 * 2 and turn == probe.reads[len(turn):2 * len(turn)]
    once = turn[::2]  # each buffer's first read of its `reads`
    assert len(set(once)) == 8 and once == once[::-1]  # all eight, forth then back
    assert all(turn[i] == turn[i + 1] for i in range(0, len(turn), 2))


@needs_thp
def test_read_gain_compares_4k_pages_with_huge_ones_and_refuses_without_them(monkeypatch):
    from labkit.bench import pages as bench_pages
    from labkit.kernels import cpu as cpu_kernels

    if cpu_kernels.kernels() is None:
        with pytest.raises(RuntimeError, match="not built"):
            bench_pages.read_gain(4 << 20, buffers=2, reads=1, n=3)
        return
    got = bench_pages.read_gain(8 << 20, buffers=2, reads=1, n=3)
    # the 2 MiB side really sat in 2 MiB pages (where the kernel had free ones: not every one)
    assert got.huge > 0
    assert all(x > 0 for x in got.gain.samples) and min(got.rates.values()) > 0
    with pytest.raises(ValueError, match="positive"):
        bench_pages.read_gain(4 << 20, buffers=0)
    monkeypatch.setenv("LABKIT_HUGE_PAGES", "0")
    with pytest.raises(RuntimeError, match="LABKIT_HUGE_PAGES=0"):
        bench_pages.read_gain(4 << 20)
    control = bench_pages.read_gain(4 << 20, buffers=2, reads=1, n=3, control=True)
    assert len(control.gain.samples) == 3  # both kinds in 4 KiB pages: no huge pages needed
    assert control.huge == 0.0  # for certain (MADV_NOHUGEPAGE), whatever the heap held before
