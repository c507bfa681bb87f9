"""torch.distributed set-up and the few collectives the trainer needs.

Under torchrun (RANK/WORLD_SIZE set) `init` starts a process group: NCCL with CUDA, gloo without.
Run as a plain process, nothing is initialised and every helper acts as the world-size-1 identity,
so the same trainer code runs both ways.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import torch
import torch.distributed as td


def init(backend: str | None = None) -> tuple[int, int]:
    """(rank, world size). Starts the process group when launched by torchrun; else (0, 1)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1
    if not td.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        td.init_process_group(backend=backend)
    return td.get_rank(), td.get_world_size()


def is_initialized() -> bool:
    return td.is_available() and td.is_initialized()


def rank() -> int:
    return td.get_rank() if is_initialized() else 0


def world_size() -> int:
    return td.get_world_size() if is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def device() -> torch.device:
    """Where this rank computes: its GPU under NCCL, else the CPU."""
    if is_initialized() and td.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Returns src's `obj` on every rank (pickled; for small control data, not tensors)."""
    if not is_initialized():
        return obj
    box = [obj if rank() == src else None]
    td.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce(t: torch.Tensor, op: Literal["sum", "max", "min"] = "sum") -> torch.Tensor:
    """In-place all-reduce of a small tensor (moved to the backend's device and back)."""
    if not is_initialized():
        return t
    ops = {"sum": td.ReduceOp.SUM, "max": td.ReduceOp.MAX, "min": td.ReduceOp.MIN}
    work = t.to(device())
    td.all_reduce(work, op=ops[op])
    t.copy_(work.to(t.device))
    return t


def barrier() -> None:
    if is_initialized():
        td.barrier()


def close() -> None:
    if is_initialized():
        td.destroy_process_group()
