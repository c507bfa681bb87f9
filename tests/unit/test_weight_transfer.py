"""The NCCL weight-transfer path, the parts that run without a GPU: what the trainer declares matches
what it writes, the proxy reads the trainer's declaration back, the engine routes come in vLLM's
order and shapes in both swap modes, and every missing piece falls back to the disk reload. The
transfer itself needs a GPU: bench/gpu_weight_transfer.py."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from proxy.rollout.engine_weights import SwapError, from_checkpoint, source_for, transfer_info, update
from proxy.upstream import ReplicaPool
from tests.engine_standin import serving
from trainer import weight_transfer as wt


def test_the_declared_update_info_is_what_the_checkpoint_holds_and_the_proxy_reads_it_back(tmp_path):
    from safetensors import safe_open

    from proxy.demo.model_zoo import cached_tiny_model
    from trainer.checkpoint import prepared_state, write_checkpoint

    base = cached_tiny_model(seed=0)
    state = {k: v.clone() for k, v in _tiny_state(base).items()}
    out = write_checkpoint(state, base_dir=base, out_dir=tmp_path / "v1", dtype="bf16")
    sent = prepared_state(state, base, "bf16")
    info = wt.update_info(sent)
    written = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as g:
            written.update({k: g.get_tensor(k) for k in g.keys()})  # noqa: SIM118 (safe_open has no iteration)
    assert info["names"] == sorted(written)
    assert info["dtype_names"] == [str(written[n].dtype).removeprefix("torch.") for n in info["names"]]
    assert set(info["dtype_names"]) == {"bfloat16"}
    assert info["shapes"] == [list(written[n].shape) for n in info["names"]]
    assert all(torch.equal(sent[n], written[n]) for n in info["names"])

    assert transfer_info(str(out)) is None  # no declaration: the engine reloads from disk
    wt.write_transfer_file(out, info)
    assert transfer_info(str(out)) == info


def _tiny_state(base: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).state_dict())


def test_the_workers_join_after_the_trainer():
    assert wt.worker_init_info("10.0.0.2", 29555, 3) == {
        "master_address": "10.0.0.2", "master_port": 29555, "rank_offset": 1, "world_size": 3, "packed": True}


class Engine:
    """Records the dev-mode and weight-transfer routes; `fail` names a route that answers 500."""

    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[tuple[str, dict | None]] = []
        self.fail = fail

    def __call__(self, request: httpx.Request) -> httpx.Response:
        route = request.url.path.strip("/")
        if route == "sleep":
            route = "pause:" + request.url.params["mode"]
        if route == "atdp/update_weights":  # a vLLM started without the extension
            return httpx.Response(404, json={"detail": "Not Found"})
        self.calls.append((route, json.loads(request.content) if request.content else None))
        return httpx.Response(500 if route == self.fail else 200, json={"success": True})


def _swap(engine: Engine, source, **kw):
    async def go():
        async with serving(engine) as (base, client):
            return await update(client, ReplicaPool([base]).replicas[0], source, timeout_s=5, **kw)

    return asyncio.run(go())


INFO = {"names": ["a.weight", "b.weight"], "dtype_names": ["bfloat16", "bfloat16"], "shapes": [[4, 2], [2]]}


def test_the_swap_calls_the_transfer_routes_with_the_declared_info_and_the_version(tmp_path):
    wt.write_transfer_file(tmp_path, INFO)
    engine = Engine()
    _swap(engine, source_for(str(tmp_path), "v7", "nccl"), mode="keep")
    assert engine.calls == [("pause:keep", None), ("reset_prefix_cache", None), ("start_weight_update", None),
                            ("update_weights", {"update_info": INFO}),
                            ("finish_weight_update", {"weight_version": "v7"}), ("resume", None)]


def test_a_failed_transfer_in_keep_mode_reloads_the_previous_checkpoint_before_resuming(tmp_path):
    wt.write_transfer_file(tmp_path, INFO)
    engine = Engine(fail="update_weights")
    with pytest.raises(SwapError, match="update_weights answered 500"):
        _swap(engine, source_for(str(tmp_path), "v7", "nccl"), mode="keep", fallback=from_checkpoint("/ckpt/v6", "v6"))
    assert [c[0] for c in engine.calls] == ["pause:keep", "reset_prefix_cache", "start_weight_update", "update_weights",
                                            "collective_rpc", "update_weight_version", "resume"]
    assert engine.calls[4][1] == {"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/v6"}}


@pytest.mark.parametrize("transfer, declared, content", [
    ("disk", True, None),  # the flag off: the declaration is ignored
    ("nccl", False, None),  # a folder posted by hand
    ("nccl", True, '{"backend": "nccl", "update_info": {"names": ["a"], "dtype_names": [], "shapes": []}}'),
    ("nccl", True, "not json"),
])
def test_anything_short_of_a_declared_transfer_reloads_from_disk(tmp_path, transfer, declared, content):
    if declared:
        if content is None:
            wt.write_transfer_file(tmp_path, INFO)
        else:
            (tmp_path / wt.TRANSFER_FILE).write_text(content)
    engine = Engine()
    _swap(engine, source_for(str(tmp_path), "v7", transfer))
    assert [c[0] for c in engine.calls] == ["pause:wait", "reset_prefix_cache", "collective_rpc", "update_weight_version",
                                            "resume"]


@dataclass
class Cfg:
    weight_transfer: str = "nccl"
    engine_url: str | None = "http://127.0.0.1:9"  # nothing listens: joining fails
    engine_api_key: str | None = None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU fallback")
def test_without_a_gpu_the_trainer_publishes_through_the_disk_and_leaves_no_declaration(tmp_path):
    asked = []
    for cfg in (Cfg(weight_transfer="disk"), Cfg()):
        result = wt.publish_version(cfg, {"w": torch.zeros(2)}, tmp_path, tmp_path, lambda: asked.append(1) or "posted",
                                    save_dtype="fp32")
        assert result == "posted"
    assert len(asked) == 2 and not (tmp_path / wt.TRANSFER_FILE).exists()
    sender = wt._senders["http://127.0.0.1:9"]
    assert not sender.connected and "no CUDA device" in sender.refused
    assert wt.publish(None, {"w": torch.zeros(2)}, tmp_path, lambda: "alone") == "alone"
