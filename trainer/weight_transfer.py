"""Publishing a version over vLLM's weight transfer engine (NCCL, GPU only), `ATDP_WEIGHT_TRANSFER=nccl`.

The checkpoint is still written (the gates load it, a rollback reloads it, the lineage names it).
What changes is how the serving engine gets the weights at the swap: instead of reading the folder
from disk (`reload_weights`), it receives them from this process over NCCL.

1. Once: join the engine's weight-transfer group. The trainer is NCCL rank 0 (the sender) and the
   engine's workers follow (rank_offset 1): `POST /init_weight_transfer_engine` with
   `worker_init_info` while this process opens its end (`vllm...nccl_common.trainer_init`); both
   block until the other arrives.
2. Each version: write `weight_transfer.json` (`TRANSFER_FILE`, the tensors' names, dtypes and
   shapes in sending order) next to the checkpoint, POST the version to the proxy in a thread and
   broadcast the same tensors. The proxy's swap (proxy.rollout.engine_weights.from_transfer) pauses
   the engine, calls `/start_weight_update`, `/update_weights` with that file's update info (the
   engine's workers receive while this process sends), `/finish_weight_update` with the version's
   name, and resumes.
Fallbacks: not connected (no GPU, no vLLM in this environment, the engine unreachable) means no
transfer file, and the proxy reloads the folder from disk as before. A candidate its gates reject
never reaches `/update_weights`: the broadcast is then abandoned and the group torn down (joined
again before the next version).

One engine (`TrainConfig.engine_url`) with one worker group; several replicas would need a group
each and one broadcast per replica in the proxy's swap order (not built).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import torch

log = logging.getLogger("atdp.trainer.transfer")

TRANSFER_FILE = "weight_transfer.json"  # read by proxy.rollout.engine_weights (same name)


def update_info(state: Mapping[str, torch.Tensor]) -> dict[str, list]:
    """vLLM's NCCL update info for `state` sent in sorted-name order (`broadcast` sends that order)."""
    names = sorted(state)
    return {"names": names, "dtype_names": [str(state[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(state[n].shape) for n in names]}


def worker_init_info(master_address: str, master_port: int, world_size: int, packed: bool = True) -> dict[str, Any]:
    """The engine workers' half of the group: ranks 1.. after the trainer's rank 0."""
    return {"master_address": master_address, "master_port": master_port, "rank_offset": 1,
            "world_size": world_size, "packed": packed}


def write_transfer_file(checkpoint: Path, info: dict[str, list]) -> Path:
    path = Path(checkpoint) / TRANSFER_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"backend": "nccl", "update_info": info}))
    tmp.replace(path)
    return path


@dataclass
class NcclSender:
    """This process's end of one engine's weight-transfer group."""

    engine_url: str
    master_address: str = "127.0.0.1"
    master_port: int = 29555
    headers: dict[str, str] = field(default_factory=dict)
    packed: bool = True
    group: Any = None  # vLLM's PyNcclCommunicator once connected
    refused: str | None = None  # why joining failed: not tried again (a rendezvous can block for minutes)

    @property
    def connected(self) -> bool:
        return self.group is not None

    def world_size(self) -> int:
        resp = httpx.get(self.engine_url + "/get_world_size", params={"include_dp": "false"}, headers=self.headers,
                         timeout=30, trust_env=False)
        resp.raise_for_status()
        return 1 + int(resp.json()["world_size"])

    def connect(self) -> None:
        """Join the group (both sides block until the other arrives). Needs vLLM and a GPU here."""
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device in this process")
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        world = self.world_size()
        body = {"init_info": worker_init_info(self.master_address, self.master_port, world, self.packed)}
        errors: list[BaseException] = []

        def engine_side() -> None:
            try:
                httpx.post(self.engine_url + "/init_weight_transfer_engine", json=body, headers=self.headers,
                           timeout=300, trust_env=False).raise_for_status()
            except BaseException as e:  # surfaced below, after our end of the rendezvous
                errors.append(e)

        thread = threading.Thread(target=engine_side, daemon=True)
        thread.start()
        group = trainer_init({"master_address": self.master_address, "master_port": self.master_port,
                              "world_size": world})
        thread.join(300)
        if errors:
            raise errors[0]
        self.group = group

    def broadcast(self, state: Mapping[str, torch.Tensor]) -> None:
        """Send every tensor, in `update_info` order, from rank 0."""
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        pairs = ((n, state[n].cuda().contiguous()) for n in sorted(state))
        if self.packed:
            packed_nccl_broadcast_producer(iterator=pairs, group=self.group, src=0, post_iter_func=lambda item: item[1])
        else:
            stream = torch.cuda.current_stream()
            for _, tensor in pairs:
                self.group.broadcast(tensor, src=0, stream=stream)
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            try:
                group.destroy()
            except Exception as e:
                log.warning("weight transfer group not torn down cleanly: %s", e)


def publish(sender: NcclSender | None, state: Mapping[str, torch.Tensor], checkpoint: Path,
            request: Callable[[], Any]) -> Any:
    """`request()` (the POST of the version to the proxy, trainer.swap.request_swap) with the weights
    broadcast alongside when `sender` is connected; else `request()` alone (the engine reads the disk).
    `state`: exactly the tensors written to `checkpoint` (trainer.checkpoint.prepared_state)."""
    if sender is None or not sender.connected:
        return request()
    write_transfer_file(checkpoint, update_info(state))
    outcome: list[Any] = []
    failure: list[BaseException] = []

    def post() -> None:
        try:
            outcome.append(request())
        except BaseException as e:
            failure.append(e)

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    sent = threading.Thread(target=_send, args=(sender, state, failure), daemon=True)
    sent.start()
    thread.join()
    sent.join(30.0)  # the engine received it if the swap went through
    if sent.is_alive() or failure:
        # Rejected before /update_weights (gates), or the transfer broke: this group is unusable.
        log.warning("weight broadcast not taken up (%s); the group is torn down and joined again next time",
                    failure[0] if failure else "no receiver")
        sender.close()
    if not outcome:
        raise failure[0]
    return outcome[0]


def _send(sender: NcclSender, state: Mapping[str, torch.Tensor], failure: list[BaseException]) -> None:
    try:
        sender.broadcast(state)
    except BaseException as e:
        failure.append(e)


_senders: dict[str, NcclSender] = {}


class PublishConfig(Protocol):
    """What publishing reads of the trainer's configuration (trainer.loop.TrainConfig has it)."""

    weight_transfer: str  # disk | nccl
    engine_url: str | None
    engine_api_key: str | None


def publish_version(cfg: PublishConfig, state: Mapping[str, torch.Tensor], base_dir: Path, checkpoint: Path,
                    request: Callable[[], Any], *, save_dtype: str) -> Any:
    """The trainer's publish step: `request()` alone (disk), or with the weights (as `save_dtype`,
    the checkpoint's) broadcast when `cfg.weight_transfer` is nccl and the engine's group can be joined."""
    if cfg.weight_transfer != "nccl" or not cfg.engine_url:
        return request()
    from trainer.checkpoint import prepared_state

    headers = {"authorization": f"Bearer {cfg.engine_api_key}"} if cfg.engine_api_key else {}
    sender = _senders.setdefault(cfg.engine_url, NcclSender(cfg.engine_url.rstrip("/"), headers=headers))
    if not sender.connected and sender.refused is None:
        try:
            sender.connect()
        except Exception as e:  # no GPU, no vLLM here, the engine started without a transfer backend
            sender.refused = f"{type(e).__name__}: {e}"
            log.warning("weight transfer group not joined (%s): the engine reloads from disk", sender.refused)
    if not sender.connected:
        return request()
    return publish(sender, prepared_state(dict(state), base_dir, save_dtype), checkpoint, request)
