"""The launcher's environment, read in one place: what torchrun (or submitit's export of it) tells a process.

``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` are set by torchrun for every process it starts; a process started
alone has none of them. Everything else asks :func:`launch_env` (before the engine exists) or the engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LaunchEnv:
    """Attributes:
        world_size: ``WORLD_SIZE``, or ``None`` where no launcher started this process.
        rank: ``RANK``, or ``None`` likewise (the process is then rank 0 of one).
        local_rank: ``LOCAL_RANK`` (0 where unset): the GPU index on its node.
        local_world_size: ``LOCAL_WORLD_SIZE`` (1 where unset): the processes of the launch on this node.
    """

    world_size: Optional[int]
    rank: Optional[int]
    local_rank: int
    local_world_size: int = 1

    @property
    def launched(self) -> bool:
        """A launcher started this process, even as the only one (DDP then wraps the model)."""
        return self.world_size is not None

    @property
    def is_main(self) -> bool:
        """Rank 0 of the launch, or a process started alone."""
        return not self.rank


def launch_env() -> LaunchEnv:
    """The environment as it is now (submitit's task export writes it after the process starts)."""

    def number(name: str) -> Optional[int]:
        value = os.environ.get(name)
        return int(value) if value is not None else None

    return LaunchEnv(world_size=number("WORLD_SIZE"), rank=number("RANK"), local_rank=number("LOCAL_RANK") or 0,
                     local_world_size=number("LOCAL_WORLD_SIZE") or 1)


def join_submitit_tasks() -> None:
    """Under ``hydra/launcher=submitit_slurm`` a job spanning several GPUs runs one SLURM task per GPU,
    each calling the Hydra job; give them the variables torchrun would (RANK, WORLD_SIZE, MASTER_*,
    LOCAL_RANK) so that the rest of the pipeline takes the same distributed path."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm" or launch_env().rank is not None:
        return
    if int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return
    from submitit.helpers import TorchDistributedEnvironment

    # Every task sees all of its node's GPUs; rm.distributed.engine picks cuda:LOCAL_RANK itself.
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
