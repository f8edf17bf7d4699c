"""Both engines implement rm.distributed.engine.Engine with its signatures: the training loop calls them alike."""

import contextlib
import inspect

import pytest
import torch

from rm.distributed.engine import AccelerateEngine, DeepSpeedEngine, Engine

METHODS = [name for name, member in vars(Engine).items() if inspect.isfunction(member) and not name.startswith("_")]


@pytest.mark.parametrize("engine", [AccelerateEngine, DeepSpeedEngine])
@pytest.mark.parametrize("name", METHODS)
def test_engines_share_the_protocol_signatures(engine, name):
    assert inspect.signature(getattr(engine, name)) == inspect.signature(getattr(Engine, name))


class RecordingAccelerator:
    """Records the loss each backward receives and whether DDP would synchronise it."""

    def __init__(self):
        self.calls, self._synced = [], True

    @contextlib.contextmanager
    def no_sync(self, model):
        self._synced = False
        try:
            yield
        finally:
            self._synced = True

    def backward(self, loss):
        self.calls.append((loss.item(), self._synced))


def test_accelerate_backward_weights_by_share_and_syncs_on_the_last():
    """Accumulation 3. An equal third is divided by 3: 7 / 3 = 2.3333333 in float32, where 7 x fl(1/3) gives
    2.3333335. An unequal share (packing) multiplies: 7 x 1/4 = 1.75. The last micro-batch of a step synchronises,
    and the process's first (once, so that DDP's buckets hold the gradients from then on); the rest do not."""
    engine = AccelerateEngine.__new__(AccelerateEngine)  # no Accelerator: only the arithmetic and the syncs are under test
    engine.accelerator, engine.accumulation, engine.model, engine._micro_batches = RecordingAccelerator(), 3, None, 0
    loss = torch.tensor(7.0)
    for share, last in ((2 / 6, False), (1 / 3, False), (1 / 4, True), (1 / 3, False), (1 / 3, True)):
        with engine.micro_batch(last=last):
            engine.backward(loss, share=share)
    third = (loss / 3).item()
    assert engine.accelerator.calls == [(third, True), (third, False), (1.75, True), (third, False), (third, True)]
    assert (loss / 3).item() != (loss * (1 / 3)).item()
