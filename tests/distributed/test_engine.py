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
    2.3333335. An unequal share (packing) multiplies: 7 x 1/4 = 1.75. Only the last micro-batch synchronises."""
    engine = AccelerateEngine.__new__(AccelerateEngine)  # no Accelerator: only backward's arithmetic is under test
    engine.accelerator, engine.accumulation, engine.model = RecordingAccelerator(), 3, None
    loss = torch.tensor(7.0)
    engine.backward(loss, share=2 / 6, last=False)
    engine.backward(loss, share=1 / 4, last=True)
    assert engine.accelerator.calls == [((loss / 3).item(), False), (1.75, True)]
    assert (loss / 3).item() != (loss * (1 / 3)).item()
