"""Run a function on N gloo ranks with Megatron's parallel_state initialised; workers are reused.

Spawning a rank costs ~5 s (torch + Megatron imports), so each world size gets one pool of worker processes
for the whole pytest session. Every call re-initialises Megatron's model-parallel groups with the sizes it
asks for, seeds Megatron's RNG tracker, clears RouterReplay's process-global instance list, drops Megatron's global MoE
metrics tracker and resets the MoE aux-loss backward scale, so calls do not leak state into each other.

Example::

    def _check(x):                       # module level, so spawned workers can import it
        from megatron.core import parallel_state
        return parallel_state.get_expert_model_parallel_rank(), x

    run_distributed(_check, 2, 7, ep=2)  # -> [(0, 7), (1, 7)]

A rank that raises fails the call with that rank's traceback; a rank that hangs (e.g. its peer died inside a
collective) fails it by timeout, and the pool is torn down and rebuilt on the next call.

Workers start as fresh interpreters (``spawn``, the default: what the benchmarks measure in), or, after
:func:`fork_workers_from_server`, forked from one server process that imported torch and the Megatron
modules the CPU patches touch once (``forkserver``): a pool then starts in well under a second
instead of ~5 s a rank, so a test may tear one down (a failure, a benchmark's fresh workers) cheaply.
Either way a worker runs under the environment of the caller that built its pool.

An idle forked pool closes itself after :data:`IDLE_CLOSE_S` seconds. Each gloo process group keeps
threads of its own (a worker grows by about 60 threads per initialisation of Megatron's groups),
and an idle worker still spends CPU on them: sampled with ``top`` through the suite, the idle
workers took about a third of one of this machine's two cores while the subprocess tests ran. The
next call forks a new pool in well under a second.
"""

import atexit
import datetime
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_ext.rehearse.rank_env import free_port

_SEQUENCE_PARALLEL = False
#: How pools start their workers: "spawn" or "forkserver" (:func:`fork_workers_from_server`).
_START_METHOD = "spawn"
#: What the fork server imports besides the modules the CPU patches touch.
_SERVER_PRELOAD = ("torch", "torch.distributed", "megatron.core.parallel_state", __name__)


@dataclass(frozen=True)
class ParallelSizes:
    """Megatron model-parallel sizes for one call."""

    tp: int = 1
    ep: int = 1
    pp: int = 1
    cp: int = 1
    sp: bool = False
    seed: int = 1234
    #: Expert tensor-parallel size; None is Megatron's default (the tensor-parallel size).
    etp: int | None = None


def sequence_parallel() -> bool:
    """Whether the current ``run_distributed`` call asked for sequence parallelism (read in workers)."""
    return _SEQUENCE_PARALLEL


def _setup_parallel(sizes: ParallelSizes) -> None:
    global _SEQUENCE_PARALLEL
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe import moe_logging
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.moe.router_replay import RouterReplay

    if not _same_groups(parallel_state, sizes):
        # Every initialize creates Megatron's process groups anew, and each gloo group keeps a TCP
        # loop thread alive after destroy_model_parallel drops it; re-creating them for every call
        # grew a worker to ~1700 polling threads (most of a core) over the suite. Same sizes: reuse.
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=sizes.tp,
            pipeline_model_parallel_size=sizes.pp,
            context_parallel_size=sizes.cp,
            expert_model_parallel_size=sizes.ep,
            expert_tensor_parallel_size=sizes.etp,
        )
    torch.manual_seed(sizes.seed)
    model_parallel_cuda_manual_seed(sizes.seed, force_reset_rng=True)
    RouterReplay.clear_global_router_replay_instances()
    # Megatron's MoE metrics tracker is process-global and sized by the first model's layer count.
    moe_logging.destroy_moe_metrics_tracker()
    # A plain backward leaves a 0-d aux-loss scale behind; Megatron's schedules expect None or [1].
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    _SEQUENCE_PARALLEL = sizes.sp


def _same_groups(parallel_state: Any, sizes: ParallelSizes) -> bool:
    """Whether Megatron's parallel state is initialised with exactly these sizes (groups reusable)."""
    if not parallel_state.model_parallel_is_initialized():
        return False
    return (
        parallel_state.get_tensor_model_parallel_world_size() == sizes.tp
        and parallel_state.get_pipeline_model_parallel_world_size() == sizes.pp
        and parallel_state.get_context_parallel_world_size() == sizes.cp
        and parallel_state.get_expert_model_parallel_world_size() == sizes.ep
        and parallel_state.get_expert_tensor_parallel_world_size() == (sizes.etp or sizes.tp)
        and parallel_state.get_virtual_pipeline_model_parallel_world_size() in (None, 1)
    )


def fork_workers_from_server() -> None:
    """Pools built from now on fork their workers from a server process that imported torch,
    Megatron's parallel state and every module :func:`megatron_ext.cpu.model_stack.enable_cpu_mode` patches
    (started on the first such pool, kept for the process). Pools already running keep theirs."""
    global _START_METHOD
    _START_METHOD = "forkserver"


def _context() -> Any:
    if _START_METHOD == "spawn":
        return mp.get_context("spawn")
    from megatron_ext import compat

    ctx = mp.get_context("forkserver")
    modules = sorted({row.module for row in compat.rows("cpu")})
    ctx.set_forkserver_preload([*_SERVER_PRELOAD, *modules])  # read when the server starts
    return ctx


def _worker(
    rank: int, world_size: int, port: int, tasks: Any, results: Any, env: dict[str, str]
) -> None:
    os.environ.clear()  # a forked worker has the server's: the pool's builder's, as spawned ones
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=10)
    )
    from megatron_ext.cpu.model_stack import enable_cpu_mode

    enable_cpu_mode()
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, args, kwargs, sizes = task
        try:
            _setup_parallel(sizes)
            results.put((task_id, rank, True, fn(*args, **kwargs)))
        except BaseException:  # report anything, including assertion errors, to the parent
            results.put((task_id, rank, False, traceback.format_exc()))


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = _context()
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, port, self.tasks[rank], self.results, dict(os.environ)),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in self.procs:
            proc.start()
        self.next_id = 0
        self.idle_timer: threading.Timer | None = None
        self.groups: tuple | None = None  # the parallel sizes its workers' groups were made for
        self.group_changes = 0

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def run(self, fn: Callable, args: tuple, kwargs: dict, sizes: ParallelSizes, timeout: float):
        task_id = self.next_id
        self.next_id += 1
        for q in self.tasks:
            q.put((task_id, fn, args, kwargs, sizes))
        done: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(done) < self.world_size:
            dead = [r for r, proc in enumerate(self.procs) if r not in done and not proc.is_alive()]
            if dead and len(done) + len(dead) >= self.world_size:
                break  # every live rank has answered; the dead never will
            if dead or any(not ok for ok, _ in done.values()):
                # A failed or dead rank's peers may be stuck in a collective: give them a moment.
                deadline = min(deadline, time.monotonic() + 5.0)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                tid, rank, ok, value = self.results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if tid == task_id:
                done[rank] = (ok, value)
        return done

    def close(self, force: bool = False) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        if not force:
            for q in self.tasks:
                q.put(None)
        for proc in self.procs:
            proc.join(timeout=0 if force else 5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


_POOLS: dict[int, _Pool] = {}
#: Held while a call uses a pool and while an idle pool is closed, so neither happens mid-call.
_POOLS_LOCK = threading.Lock()
#: Seconds a forked pool may sit unused before it closes itself (see the module docstring); spawned
#: pools (benchmarks) stay: rebuilding one costs seconds of imports per rank.
IDLE_CLOSE_S = 5.0
#: Every change of parallel sizes leaves the previous gloo groups' threads polling in each worker (a
#: worker of the suite's 2-rank pool reached ~850 threads, a third of a core, idle); a forked pool
#: is cheap to replace after this many.
MAX_GROUP_CHANGES = 8


def _pool(world_size: int, sizes: ParallelSizes) -> _Pool:
    """The live pool of ``world_size`` ranks; a forked one is replaced once its workers changed
    parallel sizes :data:`MAX_GROUP_CHANGES` times."""
    pool = _POOLS.get(world_size)
    groups = (sizes.tp, sizes.ep, sizes.pp, sizes.cp, sizes.etp or sizes.tp)
    if pool is not None and pool.alive() and groups != pool.groups:
        pool.group_changes += pool.groups is not None
        if _START_METHOD == "forkserver" and pool.group_changes > MAX_GROUP_CHANGES:
            pool.close()
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close(force=True)
        pool = _POOLS[world_size] = _Pool(world_size)
    pool.groups = groups
    return pool


def _close_when_idle(world_size: int, pool: _Pool) -> None:
    """Closes ``pool`` :data:`IDLE_CLOSE_S` seconds from now unless a call uses it first (forked
    pools only)."""
    if _START_METHOD != "forkserver":
        return
    pool.idle_timer = threading.Timer(IDLE_CLOSE_S, _close_idle, (world_size, pool))
    pool.idle_timer.daemon = True
    pool.idle_timer.start()


def _close_idle(world_size: int, pool: _Pool) -> None:
    with _POOLS_LOCK:
        # Not replaced or shut down meanwhile, and this is still the pool's timer: one that fired
        # while a call held the lock was superseded by the timer that call started (a cancel
        # cannot stop a timer that has already fired).
        current = pool.idle_timer is threading.current_thread()
        if current and _POOLS.get(world_size) is pool:
            _POOLS.pop(world_size)
            pool.close()


@atexit.register
def shutdown_pools() -> None:
    """Stops every worker pool (also runs at interpreter exit)."""
    with _POOLS_LOCK:
        for pool in _POOLS.values():
            pool.close()
        _POOLS.clear()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    tp: int = 1,
    ep: int = 1,
    pp: int = 1,
    cp: int = 1,
    sp: bool = False,
    etp: int | None = None,
    seed: int = 1234,
    timeout: float = 240.0,
    fresh: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks with Megatron parallel state set up.

    Args:
        fn: A module-level (picklable) function.
        world_size: Number of ranks (1, 2 or 4 in practice).
        *args: Positional arguments for ``fn`` (picklable; CPU tensors are fine).
        tp, ep, pp, cp: Tensor-, expert-, pipeline- and context-parallel sizes for Megatron.
        sp: Sequence parallelism; read by :func:`sequence_parallel` and the tiny model config.
        etp: Expert tensor-parallel size (None: Megatron's default, ``tp``).
        seed: Seed for torch and Megatron's model-parallel RNG tracker.
        timeout: Seconds before a hung call fails (the pool is then rebuilt).
        fresh: Run on workers of its own, started for this call and stopped after it (for ``fn``
            that leaves its process changed, e.g. with Megatron's CPU patches removed); forked
            from the server after :func:`fork_workers_from_server`, so well under a second.
        **kwargs: Keyword arguments for ``fn``.

    Returns:
        ``fn``'s return value from each rank, in rank order.

    Raises:
        RuntimeError: A rank raised (its traceback is included), its worker process died (its
            exit code is named) or it did not answer in time.
    """
    sizes = ParallelSizes(tp=tp, ep=ep, pp=pp, cp=cp, sp=sp, seed=seed, etp=etp)
    exited: dict[int, int | None] = {}
    with _POOLS_LOCK:
        pool = _Pool(world_size) if fresh else _pool(world_size, sizes)
        if pool.idle_timer is not None:
            pool.idle_timer.cancel()
        done = pool.run(fn, args, kwargs, sizes, timeout)
        failed = {rank: value for rank, (ok, value) in done.items() if not ok}
        missing = [rank for rank in range(world_size) if rank not in done]
        exited = {rank: pool.procs[rank].exitcode for rank in missing}  # None: still running
        if fresh:
            pool.close(force=bool(failed or missing))
        elif failed or missing:
            pool.close(force=True)
            _POOLS.pop(world_size, None)
        else:
            _close_when_idle(world_size, pool)
    if failed or missing:
        raise RuntimeError(_failure_message(fn, world_size, failed, exited, timeout))
    return [done[rank][1] for rank in range(world_size)]


def _failure_message(
    fn: Callable[..., Any],
    world_size: int,
    failed: dict[int, str],
    exited: dict[int, int | None],
    timeout: float,
) -> str:
    """What went wrong on each rank: its traceback, its worker's exit, or no answer in time."""
    name = getattr(fn, "__qualname__", repr(fn))
    parts = [f"rank {rank} of {world_size} failed in {name}:\n{tb}" for rank, tb in failed.items()]
    parts += [
        _exit_message(rank, world_size, code, name)
        for rank, code in exited.items()
        if code is not None
    ]
    hung = [rank for rank, code in exited.items() if code is None]
    if hung:
        parts.append(
            f"ranks {hung} of {world_size} did not finish {name} within {timeout:.0f} s "
            "(hung, or a peer died inside a collective)"
        )
    return "\n".join(parts)


def _exit_message(rank: int, world_size: int, code: int, name: str) -> str:
    """Why rank ``rank`` gave no answer: its worker process is gone."""
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    return (
        f"rank {rank} of {world_size}: its worker process {how} before finishing {name} (a "
        "crash, an out-of-memory kill, or a script calling run_distributed without an "
        "`if __name__ == '__main__':` guard: the spawned workers import it)"
    )
