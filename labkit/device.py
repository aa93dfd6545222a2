"""The device interface the decoders launch work through.

Shaped like CUDA's own model: work is *launched* onto a stream and runs in order; the host learns
it finished by waiting on an event; results come back through a host buffer. The decoders only
ever call these four methods, so the same decoder code runs on every device:

- `launch_forward(slot, plan)`: the step's forward, into decode slot `slot` (compute stream);
- `launch_sample(slot, plan, allowed)`: masks and sampling on that slot's logits (compute
  stream); the sampled tokens also land in the device's `last_tokens`, where the next forward
  reads them;
- `launch_copy(slot)`: device-to-host copy of the sampled tokens into the slot's host buffer
  (copy stream, after the sample);
- `wait_tokens(slot)`: block until that copy is done and return the tokens.

`InProcessDevice` runs each launch synchronously in the caller's thread: the simplest correct
device, used by the early notebooks and for debugging.
"""

from __future__ import annotations

import torch

from labkit.runner import ModelRunner, StepPlan

NUM_SLOTS = 2  # ping-pong: step t+1 never overwrites what the host still reads of step t


def allowed_tensor(allowed: dict[int, torch.Tensor] | None, batch: int, vocab: int,
                   device: torch.device) -> torch.Tensor | None:
    """The [B, V] bool mask from per-row masks (rows without one allow every token)."""
    if not allowed:
        return None
    mask = torch.ones(batch, vocab, dtype=torch.bool, device=device)
    for row, row_mask in allowed.items():
        mask[row] = row_mask.to(device, non_blocking=True)
    return mask


class Device:
    """Base class: the four launches every device provides."""

    name = "device"
    simulated = False

    def launch_forward(self, slot: int, plan: StepPlan) -> None:
        """Enqueue the step's forward on the compute stream."""
        raise NotImplementedError

    def launch_sample(self, slot: int, plan: StepPlan,
                      allowed: dict[int, torch.Tensor] | None = None) -> None:
        """Enqueue masking and sampling of the slot's logits on the compute stream."""
        raise NotImplementedError

    def launch_copy(self, slot: int) -> None:
        """Enqueue the device-to-host copy of the slot's tokens on the copy stream."""
        raise NotImplementedError

    def wait_tokens(self, slot: int) -> list[int]:
        """Wait for the slot's copy and return its tokens."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the device's resources."""


class InProcessDevice(Device):
    """Runs every launch at once, in the caller's thread (synchronous; for debugging)."""

    name = "in-process"

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._logits: list[torch.Tensor | None] = [None] * NUM_SLOTS
        self._tokens: list[torch.Tensor | None] = [None] * NUM_SLOTS
        self._host: list[list[int] | None] = [None] * NUM_SLOTS

    def launch_forward(self, slot: int, plan: StepPlan) -> None:
        self._logits[slot] = self.runner.forward(plan)

    def launch_sample(self, slot: int, plan: StepPlan,
                      allowed: dict[int, torch.Tensor] | None = None) -> None:
        logits = self._logits[slot]
        mask = allowed_tensor(allowed, plan.batch_size, logits.shape[-1], logits.device)
        self._tokens[slot] = self.runner.sample(plan, logits, mask)
        self._logits[slot] = None

    def launch_copy(self, slot: int) -> None:
        self._host[slot] = self._tokens[slot].tolist()

    def wait_tokens(self, slot: int) -> list[int]:
        tokens, self._host[slot] = self._host[slot], None
        assert tokens is not None, f"slot {slot}: wait_tokens without a launched copy"
        return tokens
