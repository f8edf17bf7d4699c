"""One training-step interface over accelerate (one process, DDP) and DeepSpeed's own engine (ZeRO 1-3, offload).

``rm.training.trainer`` and ``rm.training.run_setup`` talk to an engine only through :class:`Engine`: the subset of
``accelerate.Accelerator`` they need (``device``, ``process_index``,
``num_processes``, ``is_main_process``, ``autocast``, ``reduce``,
``wait_for_everyone``) plus ``micro_batch``, ``backward``, ``clip_gradients``, ``step``,
``grad_norm``, ``gradients_of``, ``stepped_parameters`` (the health checks of ``rm.training.health``), ``save_state``,
``load_state`` and ``model_state_dict`` (what ``rm.export`` saves). So the same
loop runs on one CPU, on 8 GPUs with DDP, and under ZeRO-3 with offload.

Why DeepSpeed's engine directly rather than through accelerate: accelerate
1.15 does not start DeepSpeed with several processes on a machine without
CUDA (it reports one process on every rank), while ``deepspeed.initialize``
does, with gloo. Going straight to DeepSpeed keeps one code path for CPU tests
and GPU runs. The DeepSpeed config is generated from the Hydra config by
:func:`deepspeed_config`; there is no hand-kept JSON.
"""

from __future__ import annotations

import gc
import math
import os
import random
import socket
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Protocol

import numpy as np
import torch
import torch.distributed as dist

from rm.foundations.launch_env import launch_env
from rm.foundations.precision import Precision

DEEPSPEED_BUCKET = 500_000_000  # DeepSpeed's default reduce/allgather bucket, in elements
DEEPSPEED_MAX_LIVE = 1_000_000_000  # ZeRO-3 gathered parameters kept at once (stage3_max_live_parameters), in elements


def deepspeed_buckets(zero_stage: int, hidden_size: int, trainable_params: int) -> Dict[str, int]:
    """DeepSpeed's buffer sizes (in elements) for a run; ``rm.estimate`` sizes its terms from the same numbers.

    ``reduce``: each gradient bucket, allocated at full size, never more than the trainable parameters.
    ZeRO-1/2 keep DeepSpeed's 5e8 default: one reduction at the end of the backward (measured and
    modelled). ZeRO-3 takes transformers' Trainer "auto" values (``transformers.integrations.deepspeed``,
    ``trainer_config_finalize``), scaled by the hidden size: ``reduce`` hidden^2; ``prefetch`` 0.9 x hidden^2
    parameters gathered ahead of use (DeepSpeed's 5e7 gathers a coalesced copy of up to 200 MB in fp32 beside
    each parameter's own); ``persistence``: parameters under 10 x hidden stay whole on every rank.

        >>> deepspeed_buckets(3, 4096, 7_110_664_192)
        {'reduce': 16777216, 'prefetch': 15099494, 'persistence': 40960}
        >>> deepspeed_buckets(2, 4096, 1_000_000)["reduce"]
        1000000
    """
    square = hidden_size * hidden_size
    if zero_stage < 3:
        return {"reduce": min(DEEPSPEED_BUCKET, trainable_params)}
    return {"reduce": min(square, trainable_params), "prefetch": int(0.9 * square), "persistence": 10 * hidden_size}


def deepspeed_config(
    *,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    world_size: int,
    precision: str,
    max_grad_norm: float,
    zero_stage: int,
    offload_optimizer: bool,
    offload_params: bool,
    hidden_size: int,
    trainable_params: int,
    optimizer_params: Optional[Dict] = None,
) -> Dict:
    """The DeepSpeed JSON for a run, derived from rm's settings.

    Args:
        micro_batch_size: pairs per process per forward.
        gradient_accumulation_steps: micro-batches per optimizer step.
        world_size: number of processes.
        precision: ``train.precision`` (resolved, ``rm.foundations.precision``).
        max_grad_norm: clipping threshold; 0 disables.
        zero_stage: 0-3.
        offload_optimizer: keep optimizer states on the CPU and step there (ZeRO-Offload).
        offload_params: keep ZeRO-3 parameter partitions on the CPU too.
        optimizer_params: with ``offload_optimizer``, the AdamW hyper-parameters
            (``lr``, ``betas``, ``eps``, ``weight_decay``); DeepSpeed then builds its
            CPU Adam. Otherwise the client's torch optimizer is used.
        hidden_size, trainable_params: size DeepSpeed's buffers (:func:`deepspeed_buckets`).

    Returns:
        A dict for ``deepspeed.initialize(config=...)``.

    Example:
        >>> cfg = deepspeed_config(micro_batch_size=2, gradient_accumulation_steps=4, world_size=8,
        ...     precision="bf16-mixed", max_grad_norm=1.0, zero_stage=2, offload_optimizer=False, offload_params=False,
        ...     hidden_size=4096, trainable_params=7_110_664_192)
        >>> cfg["train_batch_size"], cfg["bf16"], cfg["zero_optimization"]["stage"]
        (64, {'enabled': True}, 2)
    """
    zero: Dict = {"stage": zero_stage}
    buckets = deepspeed_buckets(zero_stage, hidden_size, trainable_params)
    zero.update(reduce_bucket_size=buckets["reduce"], allgather_bucket_size=buckets["reduce"])
    if zero_stage >= 2:
        zero.update(contiguous_gradients=True, overlap_comm=True)
    if zero_stage in (1, 2):
        # DeepSpeed's reduce-scatter path all-reduces a flattened copy of the whole bucket anyway
        # (use_multi_rank_bucket_allreduce), so it moves the same bytes as the plain all-reduce, which
        # runs in place on the contiguous bucket: one bucket-sized transient less at the end of every
        # backward, and no race on when the communication thread frees that copy (measured on gloo).
        zero["reduce_scatter"] = False
    if zero_stage == 3:
        # Without this, saving a ZeRO-3 model writes empty placeholder tensors.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
        # Stated, since rm.estimate sizes the gathered parameters from them (the live limit and the reuse
        # distance are DeepSpeed's defaults).
        zero.update(stage3_prefetch_bucket_size=buckets["prefetch"], stage3_param_persistence_threshold=buckets["persistence"],
                    stage3_max_live_parameters=DEEPSPEED_MAX_LIVE, stage3_max_reuse_distance=DEEPSPEED_MAX_LIVE)
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config: Dict = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "train_batch_size": micro_batch_size * gradient_accumulation_steps * world_size,
        "gradient_clipping": max_grad_norm,
        **Precision.of(precision).deepspeed_sections(),
        "zero_optimization": zero,
        # A torch AdamW is a well-tested client optimizer; DeepSpeed only asks for this flag.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,  # rm logs progress itself
        "wall_clock_breakdown": False,
    }
    if offload_optimizer:
        params = dict(optimizer_params or {})
        config["optimizer"] = {"type": "AdamW", "params": {**params, "betas": list(params.get("betas", (0.9, 0.999)))}}
    return config


def tensors_in(obj, depth: int = 3):
    """Tensors reachable from ``obj`` through attributes, lists, tuples and dicts, ``depth`` levels down."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 0:
        if isinstance(obj, dict):
            children = list(obj.values())
        elif isinstance(obj, (list, tuple)):
            children = list(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
            children = list(vars(obj).values())
        else:
            children = []
        for child in children:
            yield from tensors_in(child, depth - 1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rng_state() -> Dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Engine(Protocol):
    """What the training loop, checkpoints and export ask of an engine; :class:`AccelerateEngine` and
    :class:`DeepSpeedEngine` implement it with the same signatures (``tests/distributed/test_engine.py`` compares them).

    Attributes:
        device: where batches go.
        process_index, num_processes, is_main_process: this process among torchrun's.
        optimizer, scheduler: the prepared optimizer and schedule (``rm.runs.resume`` changes their settings).
    """

    device: torch.device
    process_index: int
    num_processes: int
    is_main_process: bool
    optimizer: Any
    scheduler: Any

    def prepare(self, model: torch.nn.Module, optimizer_factory: Callable, scheduler_factory: Callable) -> torch.nn.Module:
        """Wrap ``model`` for training; build the optimizer and schedule from the factories."""

    def autocast(self) -> ContextManager:
        """The context the forward runs in."""

    def micro_batch(self, last: bool) -> ContextManager:
        """The context one micro-batch's forward and :meth:`backward` run in, both of them: DDP decides in the
        forward whether the backward all-reduces.

        Args:
            last: whether this is the step's last micro-batch, after which gradients are synchronised.
        """

    def backward(self, loss: torch.Tensor, share: float) -> None:
        """Accumulate the gradient of one micro-batch's mean loss, inside :meth:`micro_batch`.

        Args:
            loss: the micro-batch's mean loss.
            share: the micro-batch's fraction of this rank's pairs in the step. Packed steps
                (``train.packing``) cut them into micro-batches of unequal sizes; weighting each mean by
                its share keeps the gradient that of the mean over the step.
        """

    def clip_gradients(self) -> Optional[float]:
        """Before :meth:`step`: clip, and return the norm before clipping (``None``: known only after the step)."""

    def step(self, skip: bool = False) -> bool:
        """Step optimizer and schedule and clear gradients; return whether the weights changed."""

    def grad_norm(self) -> Optional[float]:
        """The last step's gradient norm before clipping."""

    def gradients_of(self, module_name: str) -> List[Optional[torch.Tensor]]:
        """Full gradients of the trainable parameters under ``module_name``; every rank calls it."""

    def stepped_parameters(self) -> Optional[List[torch.Tensor]]:
        """The module's trainable parameters when they are what the optimizer writes its updates into, in a
        fixed order; ``None`` where it updates other copies of them (``rm.foundations.lost_updates`` watches these)."""

    def lr(self) -> float:
        """The learning rate of the last step."""

    def optimizer_name(self) -> str:
        """The optimizer, in words, for the run summary."""

    def state_tensors(self) -> Iterator[torch.Tensor]:
        """Weights, buffers and optimizer states: what a memory count starts from."""

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        """``tensor`` summed (or averaged, ``mean``) over processes."""

    def wait_for_everyone(self) -> None:
        """A barrier."""

    def save_state(self, directory: Path) -> None:
        """Write weights, optimizer, schedule and RNG states into ``directory``; every rank calls it."""

    def load_state(self, directory: Path) -> None:
        """Restore what :meth:`save_state` wrote."""

    def unwrapped_model(self) -> torch.nn.Module:
        """The model without the engine's wrapper."""

    def model_state_dict(self) -> Optional[Dict[str, torch.Tensor]]:
        """The state dict to save, where the model's own is incomplete (ZeRO-3 shards); every rank calls it."""

    def end(self) -> None:
        """After the run's last collective, once the caller holds no reference to the prepared model."""

    def release(self) -> None:
        """However the job ended (trained, refused, failed): undo what starting the engine changed in this process
        beyond the job, so that the next job of a Hydra sweep (one process, jobs in turn) starts from the process as
        it was; under torchrun the process ends with the job and there is nothing to undo."""


class AccelerateEngine:
    """One process, or DDP over torchrun's processes (NCCL on GPUs, gloo on CPUs), through accelerate."""

    def __init__(self, cpu: bool, precision: str, gradient_accumulation_steps: int, max_grad_norm: float):
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs

        # DDP's reducer keeps flat gradient buckets; by default param.grad is a second, separate copy.
        # As views into the buckets, the gradients cost one copy instead of two (the estimate counts one).
        ddp = DistributedDataParallelKwargs(gradient_as_bucket_view=True)
        self.accelerator = Accelerator(cpu=cpu, mixed_precision=Precision.of(precision).accelerate, kwargs_handlers=[ddp])
        self.accumulation = gradient_accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.device = self.accelerator.device
        self.process_index = self.accelerator.process_index
        self.num_processes = self.accelerator.num_processes
        self.is_main_process = self.accelerator.is_main_process
        self._norm: Optional[float] = None
        self._micro_batches = 0  # run by this process: the first all-reduces (see micro_batch)

    def prepare(self, model: torch.nn.Module, optimizer_factory: Callable, scheduler_factory: Callable) -> torch.nn.Module:
        optimizer = optimizer_factory(model)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self._ddp = isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
        # The schedule stays outside accelerate: its prepared scheduler steps once per process on each
        # call under DDP (it assumes per-process dataloader steps), which would run the schedule
        # world_size times too fast; rm counts optimizer steps itself.
        self.scheduler = scheduler_factory(self.optimizer.optimizer)
        self.accelerator.register_for_checkpointing(self.scheduler)
        return self.model

    def autocast(self) -> ContextManager:
        return self.accelerator.autocast()

    def micro_batch(self, last: bool) -> ContextManager:
        """See :meth:`Engine.micro_batch`. DDP all-reduces the step's last micro-batch, and the process's first.

        The forward is inside ``no_sync`` with the backward: DDP reads it in the forward, and a backward under
        ``no_sync`` after a forward outside it all-reduces anyway (``benchmarks/ddp_no_sync_allreduces.py``: every
        micro-batch did, 8 all-reduces for 2 steps of 4, before this). The process's first micro-batch all-reduces
        too, once: DDP rebuilds its buckets in the forward after the first all-reducing backward, and from a first
        micro-batch under ``no_sync`` every ``.grad`` would be a second copy beside the buckets until the step's end.
        Synchronised first, ``.grad`` are views of the buckets from then on, and the rebuild falls in step 1's second
        forward, before any optimizer state, where ``rm.memory.terms`` counts it. Averaging an already averaged
        gradient plus the rest of the step's gives the step's average, so the result is the same.
        """
        synchronise = last or self._micro_batches == 0
        self._micro_batches += 1
        return nullcontext() if synchronise else self.accelerator.no_sync(self.model)

    def backward(self, loss: torch.Tensor, share: float) -> None:
        """See :meth:`Engine.backward`."""
        # An equal micro-batch (share 1/accumulation, exactly so in floating point) divides by the count,
        # which is exact where multiplying by its rounded inverse may be off by one unit in the last place.
        scaled = loss / self.accumulation if share == 1 / self.accumulation else loss * share
        self.accelerator.backward(scaled)

    def clip_gradients(self) -> Optional[float]:
        """Unscale (fp16), clip to ``max_grad_norm`` when it is > 0, and return the norm before clipping.

        Called before :meth:`step`, so that a non-finite norm can keep the update from the weights.
        """
        max_norm = self.max_grad_norm if self.max_grad_norm > 0 else math.inf  # inf: the norm, no clipping
        self._norm = float(self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm))
        return self._norm

    def step(self, skip: bool = False) -> bool:
        """Step optimizer and schedule and clear gradients; return whether the weights changed.

        ``skip`` drops the update: the gradients are cleared, weights and optimizer states
        stay, and the schedule still advances (its step follows the data, not the updates).
        """
        if skip:
            scaler = self.accelerator.scaler
            if scaler is not None:  # fp16: clip_gradients unscaled; update() resets that and lowers the scale
                scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        # One process: freed gradients are memory the next forward can use. DDP's buckets hold that memory whatever
        # .grad is; .grad kept as zeroed views of them is where the next step's no_sync backwards add in place (None,
        # each would be a new tensor beside its bucket). Not before the buckets are rebuilt (the forward after the
        # first micro-batch): a view would keep its old bucket alive beside the new one, with the optimizer's states.
        keep_views = self._ddp and self._micro_batches > 1
        self.optimizer.zero_grad(set_to_none=not keep_views)
        return not skip and not self.optimizer.step_was_skipped

    def grad_norm(self) -> Optional[float]:
        """The norm :meth:`clip_gradients` returned for the last step."""
        return self._norm

    def gradients_of(self, module_name: str) -> List[Optional[torch.Tensor]]:
        """Gradients of the trainable parameters under ``module_name`` (any wrapper: DDP, PEFT's copy)."""
        return [p.grad for name, p in self.model.named_parameters() if module_name in name.split(".") and p.requires_grad]

    def stepped_parameters(self) -> Optional[List[torch.Tensor]]:
        """The optimizer's own parameters: the module's (DDP and accelerate's wrapper share them), in
        whatever dtype they are stored (bf16 with ``train.precision=bf16``, fp32 under fp16's autocast)."""
        return [p for group in self.optimizer.optimizer.param_groups for p in group["params"]]

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def optimizer_name(self) -> str:
        return type(self.optimizer.optimizer).__name__

    def state_tensors(self) -> Iterator[torch.Tensor]:
        """Weights, buffers and optimizer states: what a memory count starts from."""
        yield from self.model.parameters()
        yield from self.model.buffers()
        yield from tensors_in(self.optimizer.optimizer.state)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction=reduction)

    def wait_for_everyone(self) -> None:
        self.accelerator.wait_for_everyone()

    def save_state(self, directory: Path) -> None:
        self.accelerator.save_state(str(directory))

    def load_state(self, directory: Path) -> None:
        self.accelerator.load_state(str(directory))

    def unwrapped_model(self) -> torch.nn.Module:
        """What ``accelerator.unwrap_model`` gives for the models this engine prepares (one process, or DDP), without
        its test for a DeepSpeed engine, which imports deepspeed (a second or more) into every run."""
        model = self.model
        while isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        return model

    def model_state_dict(self) -> Optional[Dict[str, torch.Tensor]]:
        """None: every process holds the whole model, whose own state dict is the one to save."""
        self.accelerator.wait_for_everyone()
        return None

    def end(self) -> None:
        """After the run's last collective, once the caller holds no reference to the prepared (DDP) model."""
        self.accelerator.wait_for_everyone()
        # DDP's reducer holds the process group. Freed after destroy_process_group, it would drop the group's last
        # reference from a destructor that keeps the GIL while ~ProcessGroupGloo joins gloo's worker threads; a worker
        # that needs the GIL then (to free a tensor whose Python object went first) never finishes. Rank 0 of a
        # two-process CPU run hung there (2 of 18 runs; py-spy: ~ProcessGroupGloo -> thread join, from the reducer's
        # deallocation). Freed here, while the group is still registered, the wrapper leaves the group's last
        # reference to Python's handle, whose destructor releases the GIL first (torch's ProcessGroup binding).
        self.model = self.unwrapped_model()
        self.accelerator.free_memory()  # accelerate's references, then a collection: DDP holds reference cycles
        self.accelerator.end_training()

    def release(self) -> None:
        # One process: accelerate started no process group; several are torchrun's, which ends them with the process.
        pass


class DeepSpeedEngine:
    """DeepSpeed's engine (ZeRO stage 1-3, optional CPU offload), launched by torchrun, on GPUs or CPUs."""

    def __init__(self, cpu: bool, config: Dict):
        import deepspeed

        # The variables as they were, where this engine sets them (None: torchrun's, left alone); see release().
        self._saved_env: Optional[Dict[str, Optional[str]]] = None
        if launch_env().rank is None:
            # Started without torchrun (one process): give DeepSpeed the rendezvous torchrun would,
            # otherwise it falls back to MPI discovery.
            rendezvous = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
            self._saved_env = {name: os.environ.get(name) for name in rendezvous}
            os.environ.update(rendezvous)
        deepspeed.init_distributed(dist_backend="gloo" if cpu else "nccl")
        self.config = config
        self._last = True  # the running micro-batch's (micro_batch)
        self.accumulation = config["gradient_accumulation_steps"]
        self.process_index = dist.get_rank()
        self.num_processes = dist.get_world_size()
        self.is_main_process = self.process_index == 0
        local_rank = launch_env().local_rank
        if cpu:
            self.device = torch.device("cpu")
        else:
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)

    def prepare(self, model: torch.nn.Module, optimizer_factory: Callable, scheduler_factory: Callable) -> torch.nn.Module:
        import deepspeed

        # With offload DeepSpeed builds its CPU Adam from the config; otherwise it wraps our torch AdamW.
        offload = "optimizer" in self.config
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad] if offload else None,
            optimizer=None if offload else optimizer_factory(model),
            lr_scheduler=scheduler_factory,
            config=self.config,
        )
        return self.engine

    def autocast(self) -> ContextManager:
        # DeepSpeed casts the module to bf16/fp16 itself; autocast on top would only add casts.
        return nullcontext()

    def micro_batch(self, last: bool) -> ContextManager:
        """See :meth:`Engine.micro_batch`. DeepSpeed reduces at its own boundary; ``last`` is checked against it."""
        self._last = last
        return nullcontext()

    def backward(self, loss: torch.Tensor, share: float) -> None:
        """See :meth:`Engine.backward`. DeepSpeed counts micro-batches itself: ``gradient_accumulation_steps``
        equal ones per step, each loss divided by that count. ``rm.settings.validate`` refuses ``train.packing`` with
        DeepSpeed, so ``share`` and the micro-batch's ``last`` can only confirm its count; were they to differ, its
        weighting would be silently wrong, hence the error.

        Raises:
            ValueError: ``share`` is not ``1 / gradient_accumulation_steps``, or ``last`` is not DeepSpeed's boundary.
        """
        boundary = self.engine.is_gradient_accumulation_boundary()
        if not math.isclose(share * self.accumulation, 1.0) or self._last != boundary:
            raise ValueError(f"DeepSpeed accumulates {self.accumulation} equal micro-batches per step; got a share of "
                             f"{share:g} and last={self._last} where its boundary is {boundary}")
        self.engine.backward(loss)  # divides by gradient_accumulation_steps itself
        gc.collect()  # see step(): the same reference cycles form within an accumulation window
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()  # only advances DeepSpeed's micro-step counter

    def clip_gradients(self) -> Optional[float]:
        """DeepSpeed clips inside ``engine.step``, after its own overflow check: no norm before the update."""
        return None

    def step(self, skip: bool = False) -> bool:
        """At the boundary: clip, optimizer step, scheduler step, zero grads; return whether the weights changed.

        DeepSpeed offers no way to drop accumulated gradients from outside. A ``skip`` asked
        for a non-finite loss relies on its overflow check, which drops an update whose
        gradients are not finite (every ZeRO stage, fp32/bf16/fp16); the caller sees from
        the return value whether it did.
        """
        self.engine.step()
        # After a step ZeRO-1/2 can leave its old gradient partition in a reference cycle. Freed whenever
        # the garbage collector happens to run, it was alive beside the next step's partition in some runs
        # and not in others (a partition-sized swing in the peak, measured on 2 CPU processes).
        # Collecting here makes the peak the same in every run, and the lower one.
        gc.collect()
        return self.engine.was_step_applied()

    def grad_norm(self) -> Optional[float]:
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else None

    def gradients_of(self, module_name: str) -> List[Optional[torch.Tensor]]:
        """Full gradients of the trainable parameters under ``module_name``, assembled from ZeRO's partitions.

        Every rank must call it: under ZeRO-2/3 assembling a gradient is a collective.
        """
        from deepspeed.utils import safe_get_full_grad

        return [safe_get_full_grad(p) for name, p in self.engine.module.named_parameters()
                if module_name in name.split(".") and p.requires_grad]

    def stepped_parameters(self) -> Optional[List[torch.Tensor]]:
        """``None``: ZeRO (stages 1-3, with or without offload) steps flat fp32 partitions of the weights, its
        master copy in every precision (DeepSpeed's default; rm sets no bf16 master weights), and copies them
        into the module afterwards. Under bf16 an unchanged bf16 module weight is then no lost update: the
        master moved, and fp32 (24 significant bits) keeps updates down to about 1e-7 of the weight."""
        return None

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def optimizer_name(self) -> str:
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        return f"{type(inner).__name__} under DeepSpeed ZeRO-{self.config['zero_optimization']['stage']}"

    def state_tensors(self) -> Iterator[torch.Tensor]:
        """Weights, buffers, and the flat partitions and states DeepSpeed's optimizer holds."""
        yield from self.engine.module.parameters()
        yield from self.engine.module.buffers()
        yield from tensors_in(self.optimizer, depth=4)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor if reduction == "sum" else tensor / self.num_processes

    def wait_for_everyone(self) -> None:
        dist.barrier()

    def save_state(self, directory: Path) -> None:
        # DeepSpeed's save_checkpoint meets the other ranks at barriers between its writes, so a write that
        # raised on one rank would leave the others waiting there for good. Its writes (the checkpoint engine's
        # save and makedirs, the recovery script's copy) record a failure and skip the rest instead; every rank
        # reaches the end, and this rank's first failure is raised after it, for rm.runs.checkpoint to agree on.
        # No `latest` file: rm loads its fixed tag, and that plain open() could not be deferred.
        failures: List[BaseException] = []

        def deferred(write):
            def call(*args, **kwargs):
                if not failures:
                    try:
                        return write(*args, **kwargs)
                    except Exception as err:  # noqa: BLE001  (raised below, once every rank is past the barriers)
                        failures.append(err)
                return None
            return call

        writes = [(self.engine.checkpoint_engine, "save"), (self.engine.checkpoint_engine, "makedirs"),
                  (self.engine, "_copy_recovery_script")]
        originals = [getattr(owner, name) for owner, name in writes]
        for (owner, name), original in zip(writes, originals):
            setattr(owner, name, deferred(original))
        try:
            self.engine.save_checkpoint(str(directory), tag="state", save_latest=False)
        finally:
            for (owner, name), original in zip(writes, originals):
                setattr(owner, name, original)
        if failures:
            raise failures[0]
        torch.save(_rng_state(), Path(directory) / f"rng_state_{self.process_index}.pth")

    def load_state(self, directory: Path) -> None:
        self.engine.load_checkpoint(str(directory), tag="state")
        from accelerate.utils import load as safe_load  # torch.load(weights_only=True) allowing numpy's RNG arrays

        _set_rng_state(safe_load(Path(directory) / f"rng_state_{self.process_index}.pth"))

    def unwrapped_model(self) -> torch.nn.Module:
        return self.engine.module

    def model_state_dict(self) -> Optional[Dict[str, torch.Tensor]]:
        """Under ZeRO-3 the shards gathered into one state dict (every rank must call; rank 0 gets it);
        otherwise None: stages 1-2 keep whole weights on every rank."""
        state_dict = None
        if self.config["zero_optimization"]["stage"] == 3:
            state_dict = self.engine._zero3_consolidated_16bit_state_dict()
        dist.barrier()
        return state_dict

    def end(self) -> None:
        dist.barrier()

    def release(self) -> None:
        """The one-process rendezvous __init__ made, undone: its process group destroyed and RANK, WORLD_SIZE,
        MASTER_* as they were. Left in place, a sweep's next job took them for torchrun's: accelerate ran it as
        MULTI_CPU on this group, with DDP, and set torch's threads to the machine's physical cores over
        ``train.threads``' choice (OMP_NUM_THREADS unset). A CI run's two-job sweep (a refused offload job, then
        a full one) ran out its 600 s once in that state; not reproduced here, in 12 runs of 10-13 s."""
        if self._saved_env is None:
            return
        import deepspeed.comm

        # DeepSpeed's engine and optimizer hold the group: dropped first, so that the group's last reference is the
        # one destroy_process_group lets go of (see AccelerateEngine.end for the gloo hang otherwise).
        self.engine = self.optimizer = self.scheduler = None
        gc.collect()
        if dist.is_initialized():
            deepspeed.comm.destroy_process_group()
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved_env = None
