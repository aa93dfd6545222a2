"""Chapter 03 exercises: store weights in fewer bits. Fill in each function, then run `make grade`
(or the check cell in notebooks/03_quantization.ipynb). The graders are the same tests that
check labkit's own solutions, and a wrong answer says which mistake it looks like."""

import torch


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight w [N, K] to int8, symmetric, with one scale per output channel (row).

    scale[n] = max(|w[n, :]|) / 127 (fp32, shape [N]); q[n, k] = w[n, k] / scale[n] rounded
    to the NEAREST integer and kept in [-127, 127], stored as torch.int8. Return (q, scale), so
    that w ~ q * scale[:, None]. A row of zeros has max 0: give it a small positive scale
    (clamp the max to e.g. 1e-8), never 0, so its codes are 0 and not 0 / 0 = NaN.
    labkit's version: labkit/quant.py::quantize_int8.
    """
    raise NotImplementedError("quantize_int8: see the docstring for the task")


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Return the fp32 weights [N, K] that int8 codes q [N, K] and row scales [N] stand for.

    w[n, k] = q[n, k] * scale[n]. labkit's version: labkit/quant.py::dequantize_int8.
    """
    raise NotImplementedError("dequantize_int8: see the docstring for the task")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes q [N, K] (uint8 values 0..15, K even) two per byte: [N, K/2] uint8.

    Byte j of a row holds column 2j in its LOW nibble (bits 0-3) and column 2j+1 in its HIGH
    nibble (bits 4-7): [1, 2] packs to 0x21. labkit's version: labkit/quant.py::pack_int4.
    """
    raise NotImplementedError("pack_int4: see the docstring for the task")


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Undo pack_int4: [N, K/2] uint8 -> [N, K] codes 0..15 (uint8), low nibble first.

    labkit's version: labkit/quant.py::unpack_int4.
    """
    raise NotImplementedError("unpack_int4: see the docstring for the task")


def awq_scale(x: torch.Tensor, w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Search AWQ-style input-channel scales s [K] for an int4 linear w [N, K] that reads x [T, K].

    act = mean over tokens of |x| (shape [K]). For each alpha in 0, 0.05, ..., 1: s = act**alpha,
    normalised by sqrt(s.max() * s.min()); quantize w * s with int4 group-wise round-to-nearest
    (groups of `group_size` along K: 16 levels from the group's min to its max), dequantize,
    divide by s, and measure the mean squared error of x @ W_q^T against x @ w^T. Return the s
    with the smallest error. labkit's version: labkit/awq.py::search_scale.
    """
    raise NotImplementedError("awq_scale: see the docstring for the task")
