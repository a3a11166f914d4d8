"""The torchrun environment, read once: rank, world size, device, process group, teardown.

`python train.py` (no torchrun, RANK unset) is a world of one process with no process group; everything
else in the project works the same way in both cases.
"""

import dataclasses
import datetime
import importlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from . import debug
from .faults import PeerFailed
from .settings import RunError

log = logging.getLogger(__name__)
T = TypeVar("T")

LONG_TIMEOUT = datetime.timedelta(days=1)  # while a debugger may hold a rank at a breakpoint
PROBE_TIMEOUT = datetime.timedelta(seconds=2)
_store_address: tuple[str, int] | None = None  # this attempt's process group store, once it is up
CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"  # cuBLAS's deterministic setting; ":16:8" is too, with less memory


@dataclasses.dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    backend: str = "none"  # "gloo" or "nccl" once a process group is up; "none" for a single process
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1 or self.backend != "none"


def read_env() -> DistEnv:
    """Ranks from torchrun's environment variables; a single process when RANK is unset."""
    if "RANK" not in os.environ:
        return DistEnv()
    return DistEnv(
        rank=int(os.environ["RANK"]),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
    )


def resolve_backend(requested: str) -> str:
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise RunError(
            "--backend nccl needs CUDA GPUs, but torch.cuda.is_available() is False on this machine; "
            "use --backend gloo (or auto) to train on CPU"
        )
    return requested


def pick_device(backend: str, local_rank: int) -> torch.device:
    if backend == "gloo" or not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise RunError(
            f"local rank {local_rank} has no GPU: this machine has {torch.cuda.device_count()}, and nccl does not "
            "put two ranks on one GPU; use --nproc_per_node <= the number of GPUs"
        )
    return torch.device("cuda", local_rank)


def set_cpu_threads(env: DistEnv, threads_per_rank: int) -> int:
    """Split this machine's cores among its ranks: torchrun's OMP_NUM_THREADS=1 leaves cores idle, oversubscribing
    them is worse. A run's thread count is part of its numerics: keep it when you compare runs bit for bit."""
    if threads_per_rank == 0:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads_per_rank = max(1, cores // env.local_world_size)
    torch.set_num_threads(threads_per_rank)
    return threads_per_rank


def _fresh_store(env: DistEnv, timeout: datetime.timedelta) -> dist.Store:
    """A store that holds only this attempt's keys.

    torchrun's workers share the agent's store across restarts, so a restarted worker can read a dead peer's address
    left by the failed attempt and fail in gloo's connectFullMesh (pytorch/pytorch#135712; torchrun 2.13 and 2.14
    still do unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is set for the agent). So rank 0 serves a new store on a free
    port and publishes its address in the agent's store; the other ranks skip addresses that no longer answer until
    they reach it. This can go once every supported torch starts each restart with a fresh rendezvous store.
    """
    global _store_address
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        # Rank 0 hosts the bootstrap store itself, new for every attempt: nothing stale can be in it.
        _store_address = (host, port)
        return dist.TCPStore(host, port, env.world_size, is_master=env.rank == 0, timeout=timeout)
    bootstrap = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    key = "ddp_template/process_group_store"
    if env.rank == 0:
        store = dist.TCPStore("0.0.0.0", 0, env.world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        token = secrets.token_hex(8)
        store.set("token", token)
        bootstrap.set(key, f"{_advertised_host(host)}:{store.port}:{token}")
        _store_address = (_advertised_host(host), store.port)
        return store
    deadline = datetime.datetime.now() + timeout
    while True:
        addr, port_text, token = bootstrap.get(key).decode().rsplit(":", 2)
        if _accepts_connections(addr, int(port_text)):
            try:
                store = dist.TCPStore(addr, int(port_text), is_master=False, timeout=PROBE_TIMEOUT)
                if store.get("token").decode() == token:
                    store.set_timeout(timeout)
                    _store_address = (addr, int(port_text))
                    return store
            except (RuntimeError, dist.DistStoreError):
                pass  # an address from an earlier attempt; rank 0 of this one will publish its own
        else:
            time.sleep(0.02)  # a store that is gone: rank 0 of this attempt has yet to publish its own
        if datetime.datetime.now() > deadline:
            raise TimeoutError(f"rank {env.rank} found no process group store from rank 0 within {timeout}")


def store_address() -> tuple[str, int]:
    """(host, port) of this attempt's process group store (under torchrun, once the process group is up): for
    others that keep their keys per attempt too."""
    if _store_address is None:
        raise RuntimeError("no process group store: start the process group first (distributed.init)")
    return _store_address


def once_per_machine(env: DistEnv, name: str, function: Callable[[], Any]) -> None:
    """`function()` on this machine's local rank 0 while its other ranks wait, however long it takes: they poll a
    key of the job's store, not a collective, so --dist-timeout does not cut a long download short. An exception is
    raised on local rank 0; the other ranks raise PeerFailed naming `name` and that rank (if it dies, torchrun
    stops them). Ranks of a machine are numbered from `rank - local_rank`, as torchrun numbers them."""
    if not env.is_distributed or env.local_world_size == 1:
        function()
        return
    host, port = store_address()
    store = dist.TCPStore(host, port, is_master=False, timeout=LONG_TIMEOUT)
    first = env.rank - env.local_rank
    key = f"ddp_template/once/{name}/{first}"
    if env.local_rank == 0:
        outcome = "failed"
        try:
            function()
            outcome = "done"
        finally:
            store.set(key, outcome)
        return
    while not store.check([key]):
        time.sleep(0.05)
    if store.get(key).decode() != "done":
        raise PeerFailed(f"rank {first} failed in {name}")


def _accepts_connections(host: str, port: int) -> bool:
    """A plain TCP connect. The port of a store that is gone refuses it at once, where a TCPStore client
    retries for seconds: an address left by an earlier attempt then costs milliseconds, not seconds."""
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT.total_seconds()).close()
        return True
    except OSError:
        return False


def _advertised_host(master_addr: str) -> str:
    """The address other ranks reach rank 0 at: MASTER_ADDR names rank 0's machine under torchrun."""
    if master_addr in ("localhost", "127.0.0.1", "::1"):
        return master_addr
    try:
        socket.getaddrinfo(master_addr, None)
        return master_addr
    except OSError:
        return socket.getfqdn()


def collective_timeout(cfg: Any) -> datetime.timedelta:
    """How long one rank waits for the others: --dist-timeout, or a day while a debugger may hold a rank (under
    DEBUG_RANK or F5, or with --break-at-step)."""
    if debug.requested() or getattr(cfg, "break_at_step", 0) > 0:
        return LONG_TIMEOUT
    return datetime.timedelta(seconds=cfg.dist_timeout)


def use_deterministic_algorithms() -> None:
    """The same bits from the same inputs on the same GPU and software (PyTorch's reproducibility notes), at the cost
    they document: slower operations, no cuDNN benchmarking (nor inductor autotuning under --compile), and a
    RuntimeError naming any operation that has no deterministic implementation."""
    # cuBLAS reads it when it first sets up a stream's workspace: before the first matrix product. A user's is kept.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def init(env: DistEnv, cfg: Any) -> DistEnv:
    """Start the process group (when under torchrun), pick the device, and let a debugger attach."""
    if cfg.deterministic:
        use_deterministic_algorithms()  # first: before any CUDA work
    backend = resolve_backend(cfg.backend)
    device = pick_device(backend, env.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" not in os.environ:
        env = DistEnv(device=device)
    else:
        # Imported before the process group exists: imported later (by DDP or the optimizer) it keeps references to
        # the group (10 with torch 2.13), so destroy_process_group() cannot free it, and gloo's threads live on into
        # interpreter shutdown, where one can abort a run that succeeded (SIGABRT, "terminate called without...").
        importlib.import_module("torch._dynamo")
        timeout = collective_timeout(cfg)
        store = _fresh_store(env, timeout)
        dist.init_process_group(
            # With nccl, one group with two backends: CUDA tensors go through nccl, CPU tensors through gloo, so
            # control messages (agreement on snapshots, stop requests) never wait for the GPU stream.
            "cpu:gloo,cuda:nccl" if backend == "nccl" else backend,
            store=store,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
        env = dataclasses.replace(env, backend=backend, device=device)
    threads = set_cpu_threads(env, cfg.threads_per_rank) if device.type == "cpu" else torch.get_num_threads()
    log.debug("rank %d/%d up: %s, %s, %d CPU threads", env.rank, env.world_size, env.backend, env.device, threads)
    if debug.wait_for_debugger(env, at_start=not getattr(cfg, "break_at_step", 0)):
        barrier(env)  # the ranks nobody debugs wait here for those a debugger attaches to
    return env


def teardown(clean: bool) -> None:
    """Leave the process group. After a clean finish, ranks first wait for each other, so rank 0 (which serves the
    store) does not leave while others still use it; after a failure they don't: the others may never arrive."""
    if dist.is_available() and dist.is_initialized():
        if clean:
            _cpu_barrier()
        dist.destroy_process_group()


def ranks_text(ranks: list[int] | list[str]) -> str:
    """Ranks for a message: "rank 3", or "ranks 0, 2, 5"."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


# Collectives that are no-ops in a single process, so callers need not ask. Control messages use CPU tensors,
# which the process group sends through gloo also when its main backend is nccl.


def barrier(env: DistEnv) -> None:
    if env.is_distributed:
        _cpu_barrier()


def _cpu_barrier() -> None:
    """A barrier through gloo: dist.barrier() would pick nccl (and a GPU) when the group has a CUDA device."""
    dist.all_reduce(torch.zeros(1))


def all_min_max(env: DistEnv, value: int) -> tuple[int, int]:
    """(min, max) of an integer over all ranks."""
    if not env.is_distributed:
        return value, value
    both = torch.tensor([value, -value], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MIN)
    return int(both[0]), -int(both[1])


def all_gather_int(env: DistEnv, value: int) -> list[int]:
    """Every rank's integer, in rank order."""
    if not env.is_distributed:
        return [value]
    gathered = [torch.zeros((), dtype=torch.int64) for _ in range(env.world_size)]
    dist.all_gather(gathered, torch.tensor(value, dtype=torch.int64))
    return [int(each) for each in gathered]


def all_true(env: DistEnv, flag: object) -> bool:
    low, _ = all_min_max(env, int(bool(flag)))
    return bool(low)


def all_gather_object(env: DistEnv, obj: T) -> list[T]:
    """Every rank's `obj` (picklable), in rank order; through gloo also under nccl (the objects are CPU bytes)."""
    if not env.is_distributed:
        return [obj]
    gathered: list = [None] * env.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(env: DistEnv, obj: T) -> T:
    if not env.is_distributed:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0, device=torch.device("cpu"))
    return holder[0]


E = TypeVar("E", bound=Exception)


def decided_on_rank_0(env: DistEnv, decide: Callable[[], T], error: type[E]) -> T:
    """What `decide()` returns on rank 0, on every rank; where it raises `error`, every rank raises it alike: for
    what only rank 0 can check (a folder it writes, a file it reads), so no rank goes on alone."""
    problem, value = None, None
    if env.is_main:
        try:
            value = decide()
        except error as exc:
            problem = str(exc)
    problem, value = broadcast_object(env, (problem, value))
    if problem is not None:
        raise error(problem)
    return cast(T, value)


def broadcast_buffers(env: DistEnv, model: torch.nn.Module) -> None:
    """Rank 0's buffers (BatchNorm's running statistics) to every rank, in place: each rank's training forward
    updates its own, which DDP overwrites with rank 0's only at the next one. Evaluation calls this first, so every
    rank uses the statistics rank 0 saves and exports."""
    if env.is_distributed:
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def all_sum(env: DistEnv, tensor: torch.Tensor) -> torch.Tensor:
    """Sum of a tensor over ranks (a copy; the input is left alone)."""
    out = tensor.detach().clone()
    if env.is_distributed:
        dist.all_reduce(out)
    return out


def all_mean(env: DistEnv, tensor: torch.Tensor) -> torch.Tensor:
    """Mean of a tensor over ranks (a copy; the input is left alone)."""
    return all_sum(env, tensor) / env.world_size
