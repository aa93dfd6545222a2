"""Chapter 03's graders, tested by the wrong answers they must reject (STYLE rule 16)."""

from __future__ import annotations

import pytest
import torch

from labkit.graders import check


def per_tensor_int8(w):
    scale = w.abs().max() / 127  # one scale for the whole matrix
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale.expand(w.shape[0])


def minus_128_int8(w):
    scale = w.abs().amax(dim=1) / 128  # "use the whole int8 range": symmetric, but lopsided
    return torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8), scale


def truncating_int8(w):
    scale = w.abs().amax(dim=1) / 127
    return (w / scale[:, None]).to(torch.int8), scale  # .to(int8) truncates toward zero


def per_tensor_dequant(q, scale):
    return q.float() * scale[0]


def swapped_pack(q):
    return (q[:, 0::2] << 4) | q[:, 1::2]


def swapped_unpack(packed):
    return torch.stack([packed >> 4, packed & 0x0F], dim=-1).reshape(packed.shape[0], -1)


def rtn_only_awq(x, w, group_size):
    return torch.ones(x.shape[1])


@pytest.mark.parametrize("name, wrong, says", [
    ("quantize_int8", per_tensor_int8, "per-tensor"),
    ("quantize_int8", minus_128_int8, "clamped to -128 with a symmetric scale"),
    ("quantize_int8", truncating_int8, "truncated toward zero"),
    ("dequantize_int8", per_tensor_dequant, "per-tensor"),
    ("pack_int4", swapped_pack, "wrong nibble order"),
    ("unpack_int4", swapped_unpack, "wrong nibble order"),
    ("awq_scale", rtn_only_awq, "s = 1 for every channel"),
])
def test_grader_names_the_mistake(name, wrong, says):
    with pytest.raises(AssertionError) as info:
        check.grade(name, wrong)
    assert says in str(info.value), f"{name}: message {info.value!s:.200} should say {says!r}"
