"""Chapter 01 exercises: count what a step costs. Fill in each function, then run `make grade`
(or the check cell in notebooks/01_roofline.ipynb). The graders are the same tests that check
labkit's own solutions."""

from labkit.model import ModelConfig


def matmul_intensity(m: int, n: int, k: int, bytes_per_element: float) -> float:
    """Return the arithmetic intensity (FLOP per byte) of C[M, N] = A[M, K] @ B[K, N].

    FLOPs: one multiply and one add for every (m, n, k) triple. Bytes: read A and B once and
    write C once, every element `bytes_per_element` bytes (2 for bf16). Intensity = FLOPs /
    bytes. labkit's version: labkit/roofline.py::matmul_intensity.
    """
    raise NotImplementedError("matmul_intensity: see the docstring for the task")


def decode_step_flops(cfg: ModelConfig, batch: int, context_len: int) -> float:
    """Return the FLOPs of one decode step: `batch` sequences, one new token each.

    Matmuls: 2 FLOPs (a multiply and an add) per weight per token. In each of cfg.num_layers
    layers: the q and o projections (hidden_size x num_heads*head_dim each), k and v
    (hidden_size x num_kv_heads*head_dim each), the MLP's gate, up and down (hidden_size x
    intermediate_size each); once per token, the output head (hidden_size x vocab_size).
    Attention, per layer and per sequence: each of the num_heads query heads takes a dot product
    with each of the `context_len` cached keys (2 * head_dim FLOPs each) and sums as many values
    weighted by the scores (2 * head_dim FLOPs each). Ignore norms, RoPE, softmax and biases.
    labkit's version: labkit/roofline.py::decode_step_flops.
    """
    raise NotImplementedError("decode_step_flops: see the docstring for the task")


def decode_step_bytes(cfg: ModelConfig, batch: int, context_len: int, weight_bytes: float,
                      kv_bytes: float) -> float:
    """Return the bytes one decode step must move between memory and the chip.

    Three terms. Weights: every weight is read once per step, whatever the batch; the configs
    graded here tie the embedding to the output head, so that is cfg.num_params() weights of
    `weight_bytes` bytes each. KV read: each sequence reads the K and the V of all
    `context_len` tokens of its context, in every layer, for every KV head (num_kv_heads *
    head_dim values each), `kv_bytes` bytes per value. KV write: each sequence writes the K and
    V of its one new token. Ignore activations. labkit's version:
    labkit/roofline.py::decode_step_bytes.
    """
    raise NotImplementedError("decode_step_bytes: see the docstring for the task")
