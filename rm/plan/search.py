"""The layout space of a run, each candidate's memory verdict and predicted step time: what ``python -m rm.plan``
prints, and what a validation benchmark calls (:func:`plan`).

The knobs varied change where and when the same sums are computed, not the sums: the micro-batch at the same
global batch (accumulation follows), gradient checkpointing, ``train.group_by_length``, ``train.packing`` (with
and without a token budget), ``train.share_prefix``, the ZeRO stage and, for a full fine-tune, ZeRO-Offload
(``memory_profile=offload`` trains what ``full`` trains). A knob set on the command line stays as set. Where the
memory profile is not, the other profiles are candidates too, marked as changing what trains (LoRA trains
adapters, 8-bit AdamW and QLoRA round differently).

Each candidate passes :func:`rm.settings.validate.validate` (combinations it refuses, such as packing under DeepSpeed,
are skipped). Its verdict is the memory estimate ``rm.train`` decides by (:func:`rm.memory.terms.estimate_run`
at the largest micro-batches the data forms, every rank). Tracing costs about half a second a shape, so the
candidates are checked fastest first, until ``plan.top`` fit, and, apart, until one of each profile that changes
what trains fits, among its layouts predicted faster than the pick (all of them where none fits: another profile
is worth its change for speed or for a fit). A slower one is left unchecked, and one whose micro-batches outweigh
those of a layout that did not fit (the same model and engine; the estimate only grows with the micro-batches) is
inferred not to fit; each is marked so. Where the fastest layouts do not fit (a small card), the search traces the
lightest of them predicted not to fit, whose failure decides every layout that outweighs it (:class:`_Search`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sys
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

from rm.foundations.config import CONF_DIR, DistributedConfig, MemoryProfileConfig, RunConfig, TrainConfig, memory_profiles
from rm.foundations.hardware import attention_kernel, resolve_hardware, run_attention_kernel
from rm.plan import forkserver
from rm.plan.lengths import PairLengths, data_lengths, memory_shapes, step_micro_batches
from rm.plan.steptime import Rates, StepTime, predict_step_seconds

KNOBS = ("train.micro_batch_size", "train.gradient_checkpointing", "train.group_by_length", "train.packing",
         "train.max_tokens_per_micro_batch", "train.share_prefix")
# Token budgets tried with packing, in pairs of data.max_length sequences (the least rm.settings.validate allows is 1).
# A GPU also tries 16 and 32 (16,384 and 32,768 tokens at 512): a micro-batch of a few thousand tokens leaves a large
# GPU waiting on the host's launches (docs/gpu.md: 46 us an op on the H200's host), where a CPU is busy at 1,024.
BUDGET_PAIRS = (1, 2, 4, 8)
GPU_BUDGET_PAIRS = BUDGET_PAIRS + (16, 32)


@dataclass
class Candidate:
    """One layout: the overrides that make it from the config as given, its verdict and predicted step.

    Attributes:
        overrides: what to add to the command line (empty: the config as given).
        changes_math: it trains something else than the config as given (another memory profile's weights,
            optimizer or rounding), not only another layout.
        verdict: ``fits``, ``does not fit``, ``does not fit (inferred)``, ``unchecked`` (slower than those
            printed) or ``cannot be estimated``.
        note: why, where the verdict needs one.
    """

    overrides: List[str]
    changes_math: bool = False
    verdict: str = "unchecked"
    note: str = ""
    peak_bytes: Optional[int] = None
    usable_bytes: Optional[int] = None
    step: Optional[StepTime] = None
    cfg: Optional[RunConfig] = field(default=None, repr=False)
    plan: object = field(default=None, repr=False)
    family: Tuple = field(default=(), repr=False)
    size: int = 0  # the micro-batch (accumulating), what the family's verdicts are ordered by; 0: not ordered
    signature: int = field(default=0, repr=False)  # the micro-batches it forms (equal: the same batches)
    unmeasured: Tuple[str, ...] = ()  # features it turns on never timed on the run's device (rm.plan.features)
    activation_bytes: Optional[int] = field(default=None, repr=False)  # the traced activations of its estimate
    shapes: Optional[list] = field(default=None, repr=False)  # per rank, the micro-batches its estimate weighs

    @property
    def fits(self) -> bool:
        return self.verdict == "fits"

    @property
    def headroom_bytes(self) -> Optional[int]:
        return None if self.peak_bytes is None else self.usable_bytes - self.peak_bytes

    def to_dict(self) -> Dict:
        step = self.step.to_dict() if self.step else None
        return {"overrides": self.overrides, "changes_math": self.changes_math, "verdict": self.verdict,
                "note": self.note, "peak_bytes": self.peak_bytes, "usable_bytes": self.usable_bytes,
                "headroom_bytes": self.headroom_bytes, "step": step, "not_measured_on_device": list(self.unmeasured)}


@dataclass
class PlanResult:
    """Every candidate, fastest predicted first; ``given``: the config as given; ``top``: the fastest that fit and
    train what it trains."""

    candidates: List[Candidate]
    given: Candidate
    top: List[Candidate]
    lengths: PairLengths
    rates: Rates
    skipped: int  # combinations rm.settings.validate refuses
    # per profile that changes what trains, its fastest fit where faster than top[0] (or top is empty)
    other_profiles: List[Candidate] = field(default_factory=list)

    def to_dict(self) -> Dict:
        return {"lengths": self.lengths.source, "stand_in": self.lengths.stand_in, "rates": self.rates.to_dict(),
                "given": self.given.to_dict(), "top": [c.to_dict() for c in self.top],
                "other_profiles": [c.to_dict() for c in self.other_profiles],
                "candidates": [c.to_dict() for c in self.candidates], "refused_by_validation": self.skipped}


def set_keys(overrides: Sequence[str]) -> set:
    """The keys (and groups) a command line sets: ``train.packing=true`` -> ``train.packing``."""
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}


def group_option(group: str, name: str):
    """A config group's option read from ``conf/<group>/<name>.yaml`` into its schema (no Hydra composition)."""
    from omegaconf import OmegaConf

    from rm.foundations.config import GROUPS

    values = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{name}.yaml"))
    values.pop("defaults", None)
    return GROUPS[group](**values)


def _math(profile: MemoryProfileConfig) -> tuple:
    """What a profile trains and how it rounds: ``offload`` trains what ``full`` does, elsewhere."""
    return profile.use_lora, profile.quantize_base, profile.optimizer


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layouts(train_cfg: TrainConfig, max_length: int, fixed: set, per_rank: int,
             budget_pairs: Sequence[int] = BUDGET_PAIRS) -> List[Dict]:
    """The training-layout knobs' combinations (values of :data:`KNOBS`), the user's kept; ``max_length``:
    ``data.max_length``, which the token budgets tried are multiples of (``budget_pairs`` pairs of it)."""
    t = train_cfg

    def values(key, options):
        return [getattr(t, key.split(".")[1])] if key in fixed else options

    out = []
    for ckpt in values("train.gradient_checkpointing", [True, False]):
        for share in values("train.share_prefix", [False, True]):
            for packing in values("train.packing", [False, True]):
                budgets = [0]
                if packing:
                    budgets = values("train.max_tokens_per_micro_batch",
                                     [0] + [k * 2 * max_length for k in budget_pairs if k < per_rank])
                for budget in budgets:
                    micros = values("train.micro_batch_size", _divisors(per_rank)) if not budget else [t.micro_batch_size]
                    for micro in micros:
                        # grouping changes nothing where a step is one micro-batch of pairs
                        matters = budget or micro < per_rank
                        for group in values("train.group_by_length", [True, False]) if matters else [t.group_by_length]:
                            out.append({"micro_batch_size": micro, "gradient_checkpointing": ckpt,
                                        "group_by_length": group, "packing": packing,
                                        "max_tokens_per_micro_batch": budget, "share_prefix": share})
    return out


def _engines(given_profile: MemoryProfileConfig, given_dist: DistributedConfig, overrides: Sequence[str], fixed: set,
             world: int) -> List[Tuple[List[str], MemoryProfileConfig, DistributedConfig, bool]]:
    """(overrides, profile, distributed, changes_math) of each memory profile (:func:`rm.foundations.config.memory_profiles`, found
    through ``overrides``' config search path) and distribution tried; ``given_profile``, ``given_dist``: the run's."""
    profile_fixed = any(k == "memory_profile" or k.startswith("memory_profile.") for k in fixed)
    # distributed.num_processes says how many processes, not how they share the work
    dist_fixed = bool(fixed & {"distributed", "distributed.strategy", "distributed.zero_stage", "distributed.offload_params"})
    profiles = [(given_profile.name, given_profile)] if profile_fixed else \
        [(p.name, given_profile if p.name == given_profile.name else p) for p in memory_profiles(overrides)]
    out = []
    for name, profile in profiles:
        pick = [] if name == given_profile.name else [f"memory_profile={name}"]
        changes = _math(profile) != _math(given_profile)
        if dist_fixed:
            dists = [([], given_dist)]
        elif world == 1:  # one process: ZeRO shards nothing; DeepSpeed only where offload needs it (auto picks it)
            dists = [([], given_dist)] if given_dist.name == "auto" else \
                [(["distributed=auto"], group_option("distributed", "auto"))]
        else:
            dists = [([] if given_dist.name == "ddp" else ["distributed=ddp"], group_option("distributed", "ddp"))]
            for stage in (1, 2, 3):
                dists.append(([f"distributed=zero{stage}"], group_option("distributed", f"zero{stage}")))
            if profile.offload_optimizer:
                dists.append((["distributed=zero3_offload"], group_option("distributed", "zero3_offload")))
        for extra, dist in dists:
            out.append((pick + extra, profile, dist, changes))
    return out


def _knob_overrides(train_cfg: TrainConfig, knobs: Dict) -> List[str]:
    return [f"train.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in knobs.items()
            if getattr(train_cfg, k) != v]


def candidates(cfg: RunConfig, overrides: Sequence[str], world: Tuple,
               fixed: Optional[set] = None) -> Tuple[List[Candidate], int]:
    """Every candidate that passes validation (not yet timed or checked), and how many did not.

    Args:
        world: :func:`rm.settings.validate.resolve_world_size`'s answer for ``cfg``.
        fixed: the keys (and groups) that stay as they are; default: those ``overrides`` set.
    """
    from rm.settings.validate import ConfigError, validate

    fixed = set_keys(overrides) if fixed is None else fixed
    per_rank = cfg.train.global_batch_size // world[0]
    out, skipped = [], 0
    budget_pairs = GPU_BUDGET_PAIRS if resolve_hardware(cfg.hardware).accelerator != "cpu" else BUDGET_PAIRS
    for extra, profile, dist, changes in _engines(cfg.memory_profile, cfg.distributed, overrides, fixed, world[0]):
        for knobs in _layouts(cfg.train, cfg.data.max_length, fixed, per_rank, budget_pairs):
            c_cfg = replace(cfg, memory_profile=profile, distributed=dist, train=replace(cfg.train, **knobs))
            try:
                c_plan = validate(c_cfg, *world)
            except ConfigError:
                skipped += 1
                continue
            family = (tuple(extra), *(v for k, v in knobs.items() if k != "micro_batch_size"))
            accumulating = not knobs["max_tokens_per_micro_batch"] and knobs["micro_batch_size"] < per_rank
            out.append(Candidate(overrides=extra + _knob_overrides(cfg.train, knobs), changes_math=changes, cfg=c_cfg,
                                 plan=c_plan, family=family, size=knobs["micro_batch_size"] if accumulating else 0))
    return out, skipped


def verdict(candidate: Candidate, lengths: PairLengths) -> None:
    """The memory verdict ``rm.train`` would reach for this candidate on these lengths, filled in place."""
    from rm.memory.terms import cannot_fit, worst_rank_estimate

    c_cfg, c_plan = candidate.cfg, candidate.plan
    if cannot_fit(c_cfg, c_plan):
        candidate.verdict, candidate.note = "does not fit", "weights, gradients and optimizer states alone"
        return
    try:
        worst = worst_rank_estimate(c_cfg, c_plan, memory_shapes(c_cfg.train, c_plan, lengths))
    except ValueError as err:  # an attention implementation the trace cannot run
        candidate.verdict, candidate.note = "cannot be estimated", str(err)
        return
    candidate.peak_bytes, candidate.usable_bytes = worst.peak_bytes, worst.usable_bytes
    candidate.activation_bytes = worst.activations
    candidate.verdict = "fits" if worst.fits else "does not fit"


def _verdict_job(job: Tuple[Candidate, PairLengths]) -> Tuple:
    c, lengths = job
    c = replace(c)  # found here or in a worker alike: the candidate itself takes it in Checker.apply, in order
    verdict(c, lengths)
    return c.verdict, c.note, c.peak_bytes, c.usable_bytes, c.activation_bytes


def _worker_started(environ: Dict[str, str], cwd: str) -> None:
    """A worker takes this process's environment and directory as they are now (``RM_CACHE`` included), not the
    forkserver's from when it started."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.stdout = sys.stderr  # a worker never prints the answer: stdout stays the answer's alone (plan.json=true)


class Checker:
    """Memory verdicts (:func:`verdict`) of candidates: those whose traces are cached, here; the others in two worker
    processes where a second core and a forkserver allow, else here too.

    A trace is single-threaded Python (fake tensors dispatch op by op), and the first one in a process first imports
    the model's code (about 5 s). So as the search starts, a forkserver begins those imports (:mod:`rm.plan.warm`)
    on the other core while this process reads lengths and times layouts; the workers are forked from it, warm, at
    the first trace that is not cached (a thread here waits for them, the search goes on), and get their candidates
    pickled. A search whose traces are all cached never waits for them. ``workers=1`` (a training process forks
    nothing), one core, no forkserver (Windows) or CUDA initialised here: every verdict in this process.

    Use as a context manager; :meth:`submit` starts verdicts, :meth:`apply` waits for them and fills them in.
    """

    def __init__(self, workers: int = 2):
        self.context = forkserver.context() if workers >= 2 else None
        self.pool = None
        self._starting: Optional[concurrent.futures.ThreadPoolExecutor] = None  # the thread that starts the pool
        self._started: Optional[concurrent.futures.Future] = None

    @property
    def workers(self) -> int:
        return 1 if self.context is None else 2

    def __enter__(self) -> "Checker":
        if self.context is not None:
            forkserver.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._starting is not None:
            with contextlib.suppress(Exception):  # a pool that failed to start has raised in apply() already
                self._started.result()
            self._starting.shutdown()
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()  # the forkserver stays, idle, for this process's next search
        elif self.context is not None and self._starting is None:  # every trace was cached: its imports are not wanted
            forkserver.stop()

    def submit(self, batch: List[Candidate], lengths: PairLengths, ahead: bool = False) -> Optional["_Submitted"]:
        """Start the verdicts of ``batch``: those whose traces are cached are found here and now. ``ahead``: verdicts
        that may not be needed, which never start the workers (a search whose traces are all cached would wait for
        their imports to stop them): ``None`` where they would have to."""
        from rm.memory.trace import NotTraced, cached_only

        out = _Submitted(batch, [None] * len(batch))
        for i, c in enumerate(batch):
            try:
                with cached_only() if self.context is not None else contextlib.nullcontext():
                    out.results[i] = _verdict_job((c, lengths))
            except NotTraced:
                out.sent.append(i)
        if out.sent:
            jobs = [(batch[i], lengths) for i in out.sent]
            if ahead and self._starting is None:
                return None
            if self._starting is None:
                # Starting the workers waits for the forkserver's imports (seconds): a thread waits, and sends them
                # these jobs, while this process goes on with its search.
                self._starting = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rm-plan-workers")
                self._started = self._starting.submit(self._start, jobs, dict(os.environ), os.getcwd())
                out.pending = self._started
            else:
                self._started.result()
                out.pending = self.pool.map_async(_verdict_job, jobs, chunksize=1)
        return out

    def _start(self, jobs: List[Tuple], environ: Dict[str, str], cwd: str):
        self.pool = self.context.Pool(2, _worker_started, (environ, cwd))
        return self.pool.map_async(_verdict_job, jobs, chunksize=1)

    @staticmethod
    def apply(submitted: "_Submitted") -> List[Candidate]:
        """Wait for verdicts :meth:`submit` started and fill them into their candidates (once); returns them."""
        if submitted.applied:
            return submitted.batch
        submitted.applied = True
        if submitted.sent:
            pending = submitted.pending
            if isinstance(pending, concurrent.futures.Future):  # the jobs that started the pool
                pending = pending.result()
            for i, result in zip(submitted.sent, pending.get()):
                submitted.results[i] = result
        for c, result in zip(submitted.batch, submitted.results):
            c.verdict, c.note, c.peak_bytes, c.usable_bytes, c.activation_bytes = result
        return submitted.batch


@dataclass
class _Submitted:
    """Verdicts :meth:`Checker.submit` started: ``results`` per candidate of ``batch``, those at ``sent`` still coming
    from the workers (``pending``)."""

    batch: List[Candidate]
    results: List[Optional[Tuple]]
    sent: List[int] = field(default_factory=list)
    pending: object = None  # multiprocessing's AsyncResult, or a Future of one (the jobs that start the pool)
    applied: bool = False


class _Search:
    """What :func:`check_fastest` knows as it goes: the verdicts traced so far (``failures`` those that did not fit,
    ``points`` each memory group's peaks), from which a verdict is inferred or a probe picked. A memory group is a
    set of candidates that differ only in how the same pairs are cut into micro-batches (micro-batch size, grouping,
    token budget): the same model, engine and numerics, estimated alike but at other shapes."""

    def __init__(self, lengths: PairLengths):
        self.lengths = lengths
        self.failed: Dict[Tuple, int] = {}  # family -> the smallest accumulating micro-batch that did not fit
        self.failures: List[Candidate] = []
        self.points: Dict[str, List[Tuple[int, int, int, int]]] = {}  # kin -> (tokens, peak, activations, usable)
        self._keys: Dict[Tuple[int, bool], str] = {}

    def _key(self, c: Candidate, accumulation: bool) -> str:
        """What ``c``'s estimate depends on besides its shapes: its config but for how the pairs are cut into
        micro-batches, and with ``accumulation``, whether they accumulate (the estimate reads nothing more of it)."""
        if (id(c), accumulation) not in self._keys:
            t = replace(c.cfg.train, micro_batch_size=0, group_by_length=False, max_tokens_per_micro_batch=0)
            steps = min(c.plan.gradient_accumulation_steps, 2) if accumulation else 1
            plan = replace(c.plan, micro_batch_size=0, warnings=(), gradient_accumulation_steps=steps)
            self._keys[id(c), accumulation] = repr((replace(c.cfg, train=t), plan))
        return self._keys[id(c), accumulation]

    def group(self, c: Candidate) -> str:
        """Its memory group: verdicts are inferred within one."""
        return self._key(c, accumulation=True)

    def kin(self, c: Candidate) -> str:
        """Its group, accumulating or not: the peaks a prediction reads (a guess, so a step of one micro-batch and one
        of several inform each other; verdicts are never inferred across them)."""
        return self._key(c, accumulation=False)

    def shapes(self, c: Candidate) -> list:
        if c.shapes is None:
            c.shapes = memory_shapes(c.cfg.train, c.plan, self.lengths)
        return c.shapes

    def tokens(self, c: Candidate) -> int:
        from rm.memory.terms import micro_batch_phases

        return max(b.rows * b.length for s in self.shapes(c) for b, *_ in micro_batch_phases(s))

    def outweighs(self, heavier: Candidate, lighter: Candidate) -> bool:
        from rm.memory.terms import outweighs

        if self.group(heavier) != self.group(lighter):
            return False
        segmented = heavier.cfg.train.packing and attention_kernel(heavier.cfg.model.attn_implementation) == "segments"
        return outweighs(self.shapes(heavier), self.shapes(lighter), segmented)

    def inferred(self, c: Candidate, failures: Sequence[Candidate] = ()) -> Optional[str]:
        """Why ``c`` cannot fit, known without its trace (``failures``: more taken as not fitting); else None."""
        if c.size and c.family in self.failed and self.failed[c.family] <= c.size:
            return f"train.micro_batch_size={self.failed[c.family]} of this layout does not"
        for f in [*self.failures, *failures]:
            if f is not c and self.outweighs(c, f):
                return f"its micro-batches outweigh those of {' '.join(f.overrides) or 'the config as given'}, " \
                       "which does not"
        return None

    def predicted(self, c: Candidate) -> Optional[Tuple[int, int]]:
        """A guess at ``c``'s peak and its usable memory, from the traced peak of its kin (:meth:`kin`) nearest in
        tokens (activations scaled by tokens), to pick a probe by; never a verdict. None before its kin's first
        trace."""
        points = self.points.get(self.kin(c))
        if not points:
            return None
        tokens = self.tokens(c)
        near, peak, activations, usable = min(points, key=lambda p: abs(p[0] - tokens))
        return peak - activations + activations * tokens // max(near, 1), usable

    def fails_predicted(self, c: Candidate) -> Optional[bool]:
        guess = self.predicted(c)
        return None if guess is None else guess[0] > guess[1]

    def probe(self, c: Candidate, pool: Sequence[Candidate], failures: Sequence[Candidate] = ()) -> Candidate:
        """What to trace to decide ``c``: where ``c`` is predicted not to fit, the lightest candidate of ``pool`` it
        outweighs that is predicted not to fit either (its failure then decides ``c`` and every other candidate
        outweighing it, one trace for many); else ``c`` itself."""
        if not self.fails_predicted(c):
            return c
        lighter = [d for d in pool if d is not c and d.verdict == "unchecked" and d.overrides
                   and self.group(d) == self.group(c) and self.fails_predicted(d)
                   and not self.inferred(d, failures) and self.outweighs(c, d)]
        return min(lighter, key=lambda d: self.predicted(d)[0], default=c)

    def record(self, c: Candidate) -> None:
        """A traced verdict, learnt from."""
        if c.peak_bytes is not None:
            self.points.setdefault(self.kin(c), []).append((self.tokens(c), c.peak_bytes, c.activation_bytes or 0,
                                                                c.usable_bytes))
        if c.verdict == "does not fit" and c.peak_bytes is not None:
            self.failures.append(c)
            if c.size:
                self.failed[c.family] = min(c.size, self.failed.get(c.family, c.size))

    def targets(self, queue: Sequence[Candidate], top: int, fitting: int, given: Candidate, k: int) -> List[Candidate]:
        """The next ``k`` traces the search will likely want, from the head of ``queue`` on: each undecided
        candidate's probe (the first is the head's), supposing each prediction right."""
        failures: List[Candidate] = []
        out: List[Candidate] = []
        unknown = set()  # kins with no trace yet, one of whose candidates is among the targets
        for d in queue:
            if fitting >= top or len(out) >= k:
                break
            if not d.overrides:
                fitting += given.verdict in ("fits", "unchecked")
                continue
            if d.verdict != "unchecked":
                fitting += d.fits
                continue
            if any(d is f for f in failures) or self.kin(d) in unknown or self.inferred(d, failures):
                continue  # (a kin's first trace may decide the rest of it: they wait for it)
            target = self.probe(d, queue, failures)
            if not any(target is t for t in out):
                out.append(target)
            guess = self.fails_predicted(d)
            if guess is None:
                unknown.add(self.kin(d))
            elif target is not d or guess:
                failures.append(target)
            else:
                fitting += 1
        return out


def check_fastest(queue: List[Candidate], top: int, lengths: PairLengths, given: Candidate,
                  checker: Optional[Checker] = None, given_pending: Optional[_Submitted] = None,
                  started: Optional[Dict[int, _Submitted]] = None, alongside: Sequence[Candidate] = ()) -> List[Candidate]:
    """Check the candidates (fastest first) until ``top`` fit; returns those, fastest first. The config as given
    takes its verdict from ``given``, waiting for ``given_pending`` (its verdict, submitted to ``checker``) only when
    it is reached. ``checker``: where verdicts are computed (default: in this process). ``started``: verdicts
    already started, by id of their candidate (kept across searches that share it); ``alongside``: the first
    candidate of each later search, which checks those faster than this one's first fit: each is started ahead once
    the search has reached a candidate slower than it.

    A candidate is inferred not to fit, with no trace, where one that did not fit is outweighed by it: the same
    model and engine, each micro-batch at most as large (:func:`rm.memory.terms.outweighs`), or the same layout at a
    smaller accumulating micro-batch. Where the fastest layouts do not fit, most verdicts come so: a candidate
    predicted not to fit (its group's traced peaks, scaled by tokens) is decided by tracing the lightest one it
    outweighs that is predicted not to fit either (:meth:`_Search.probe`), which, failing, decides it and all others
    outweighing it.

    The candidates are decided one at a time, in order, so the answer does not hang on which verdict comes back
    first. With workers, the traces the next candidates will likely want (:meth:`_Search.targets`) are started
    ahead, one more than there are workers, so that none waits for the slowest; more would queue guesses in front
    of the traces a probe's answer calls for. A verdict started ahead and not reached is left out (its candidate
    stays ``unchecked``)."""
    search = _Search(lengths)
    fitting: List[Candidate] = []
    checker = checker or Checker(workers=1)
    started = {} if started is None else started  # id(candidate) -> its verdict, started
    alongside = list(alongside)

    for i, c in enumerate(queue):
        if len(fitting) >= top:
            break
        while c.verdict == "unchecked":
            why = search.inferred(c)
            if why:
                c.verdict, c.note = "does not fit (inferred)", why
            elif not c.overrides:  # the config as given
                if given_pending is not None:
                    checker.apply(given_pending)
                c.verdict, c.note, c.peak_bytes, c.usable_bytes = given.verdict, given.note, given.peak_bytes, given.usable_bytes
                break
            else:
                ahead = 1 if checker.workers == 1 else checker.workers + 1
                targets = search.targets(queue[i:], top, len(fitting), given, ahead)
                # The pick is the head or slower: a later search's candidate faster than the head will be wanted.
                wanted = [d for d in alongside if d.step.seconds < c.step.seconds]
                for d in targets + wanted:
                    if id(d) not in started:
                        submitted = checker.submit([d], lengths, ahead=d is not targets[0])
                        if submitted is not None:
                            started[id(d)] = submitted
                alongside = [d for d in alongside if not any(d is w for w in wanted)]
                checker.apply(started.pop(id(targets[0])))
                search.record(targets[0])
        if c.fits:
            fitting.append(c)
    return fitting


class _Timer:
    """Step shapes per batching (shared by every candidate that batches alike) and each candidate's prediction."""

    def __init__(self, lengths: PairLengths, rates: Rates, steps: int):
        self.lengths, self.rates, self.steps, self.shapes = lengths, rates, steps, {}

    def __call__(self, c: Candidate) -> StepTime:
        from rm.data.shapes import layout_of

        t, p = c.cfg.train, c.plan
        key = (layout_of(t.packing, t.share_prefix), p.micro_batch_size, p.world_size, t.global_batch_size, t.seed,
               t.group_by_length, t.max_tokens_per_micro_batch, run_attention_kernel(c.cfg, p))
        if key not in self.shapes:
            shapes = step_micro_batches(self.lengths, *key[:7], steps=self.steps, kernel=key[7])
            self.shapes[key] = shapes, hash(tuple(mb for step in shapes for rank in step for mb in rank)), {}
        shapes, c.signature, memo = self.shapes[key]
        return predict_step_seconds(c.cfg, p, shapes, self.rates, memo)


def plan(cfg: RunConfig, overrides: Sequence[str] = (), lengths: Optional[PairLengths] = None,
         rates: Optional[Rates] = None, top: Optional[int] = None) -> PlanResult:
    """The layout space of ``cfg``: each candidate's predicted step time, and the memory verdict of the fastest
    until ``top`` (default ``plan.top``) fit.

    Args:
        cfg: the typed run config as composed.
        overrides: the command line it was composed from; a knob set there is kept.
        lengths: the data's lengths (default: :func:`rm.plan.lengths.data_lengths` of ``cfg``).
        rates: the hardware's (default: :func:`rm.plan.constants.rates_for` of the resolved hardware).

    Raises:
        ConfigError: ``cfg`` itself does not validate, or ``plan.*`` is out of range.
    """
    from rm.data.build import check_enough_pairs
    from rm.foundations.errors import ConfigError
    from rm.plan.constants import rates_for
    from rm.settings.validate import resolve_world_size, validate

    top = cfg.plan.top if top is None else top
    bad = [f"plan.{key}={getattr(cfg.plan, key)} must be >= 1" for key in ("top", "steps", "stand_in_pairs")
           if getattr(cfg.plan, key) < 1]
    if bad:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(bad))
    world = resolve_world_size(cfg.distributed, launched=False)
    given_plan = validate(cfg, *world)
    with Checker() as checker:  # its workers' imports start now, alongside this process's work
        rates = rates or rates_for(given_plan.hardware, given_plan.device)
        lengths = lengths or data_lengths(cfg.data, cfg.model, cfg.plan.stand_in_pairs)
        if lengths.stand_in and len(lengths.chosen) < cfg.train.global_batch_size:
            raise ConfigError(f"plan.stand_in_pairs={cfg.plan.stand_in_pairs} is fewer than one optimizer step takes "
                              f"(train.global_batch_size={cfg.train.global_batch_size}): raise it")
        check_enough_pairs(cfg.data, cfg.train, len(lengths.chosen), given_plan.world_size)  # no step could be cut from fewer
        given = Candidate([], cfg=cfg, plan=given_plan)
        given_verdict = checker.submit([given], lengths)
        timer = _Timer(lengths, rates, cfg.plan.steps)
        found, skipped = candidates(cfg, overrides, world)
        from rm.plan.features import unmeasured

        for c in found + [given]:
            c.step = timer(c)
            c.unmeasured = unmeasured(c.cfg.train, given_plan.device)
        # A prediction for a feature no run on this kind of device has timed is a guess at its kernels' rate (packed
        # rows once ran 6x slower than padded on an H200): those rank after every layout that was timed there.
        found.sort(key=lambda c: (bool(c.unmeasured), c.step.seconds, c.changes_math, len(c.overrides)))
        # Layouts that form the very same micro-batches (packing one pair, grouping micro-batches of one): the
        # fewest overrides stand for them.
        unique: Dict[Tuple, Candidate] = {}
        for c in sorted(found, key=lambda c: len(c.overrides)):
            unique.setdefault((c.family[0], c.cfg.train.gradient_checkpointing, c.signature), c)
        found = [c for c in found if unique[(c.family[0], c.cfg.train.gradient_checkpointing, c.signature)] is c]
        # Training something else is worth suggesting for speed, or for a fit where the profile as given has none:
        # each other profile's fastest fit, among its layouts predicted faster than the pick (any, where none fits).
        # Each one's fastest layout is started alongside the search for the pick, once that is known to be slower.
        fastest: Dict[str, Candidate] = {}
        for c in found:
            if c.changes_math:
                fastest.setdefault(c.cfg.memory_profile.name, c)
        started: Dict[int, _Submitted] = {}
        # The fastest candidates' traces start beside the given config's, which is waited for only where needed.
        fitting = check_fastest([c for c in found if not c.changes_math], top, lengths, given, checker, given_verdict,
                                started, list(fastest.values()))
        checker.apply(given_verdict)
        bound = fitting[0].step.seconds if fitting else float("inf")
        others = []
        for name in fastest:
            faster = [c for c in found if c.changes_math and c.cfg.memory_profile.name == name and c.step.seconds < bound]
            others += check_fastest(faster, 1, lengths, given, checker, started=started)
    others.sort(key=lambda c: c.step.seconds)
    return PlanResult(found, given, fitting, lengths, rates, skipped, others)
