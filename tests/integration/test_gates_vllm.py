"""The replay gate on the real engine (vLLM CPU, the tiny model): a worse candidate is rejected, an
identical one passes and is promoted, and the engine serves the serving weights again after each.

The operator suite is built by construction from the base model itself: its expected answers are
the base weights' own greedy answers (`exact`), so the base passes it by definition. The worse
candidate is the base weights with Gaussian noise added (half of each tensor's std, fixed seed):
named for what it is, a perturbed model, not a model trained on negated rewards. The good candidate
is a byte-identical copy of the base checkpoint under another path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

ADMIN = {"authorization": "Bearer admin-test-key"}
PROMPTS = ["hello there", "what is 12 + 7?", "the quick brown fox", "say a number", "name a colour", "good morning"]
MAX_TOKENS = 8

pytestmark = pytest.mark.vllm



def perturbed_checkpoint(base_dir: Path, out_dir: Path, *, scale: float = 0.5, seed: int = 3) -> Path:
    """The base weights plus N(0, (scale * std)^2) noise per tensor: a deliberately worse model."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.checkpoint import gather_full_state_dict, write_checkpoint

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, w in model.named_parameters():
            w.add_(scale * w.std() * torch.randn(w.shape, generator=g))
    return write_checkpoint(gather_full_state_dict(model), base_dir=base_dir, out_dir=out_dir, dtype="fp32")


def _greedy(base_url: str, model: str, prompt: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0, "seed": 0,
            "max_tokens": MAX_TOKENS}
    return httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]["content"]


def test_replay_gate_rejects_a_perturbed_model_and_passes_an_identical_one(start_proxy, vllm_server, own_db,
                                                                          tmp_path):
    from tests.vllm_fixtures import swap_weights

    url, _factory = own_db
    expected = {p: _greedy(vllm_server.base_url, vllm_server.model, p) for p in PROMPTS}
    suites = tmp_path / "suites"
    suites.mkdir()
    (suites / "base-answers.jsonl").write_text("".join(
        json.dumps({"id": f"p{i}", "tenant": "acme" if i % 2 else "globex", "max_tokens": MAX_TOKENS,
                    "messages": [{"role": "user", "content": p}], "evaluator": "exact", "expected": expected[p]}) + "\n"
        for i, p in enumerate(PROMPTS)))
    worse = perturbed_checkpoint(vllm_server.model_dir, tmp_path / "perturbed")
    same = tmp_path / "same"
    shutil.copytree(vllm_server.model_dir, same)

    proxy = start_proxy([vllm_server.base_url], database_url=url, eval_suites=suites, eval_concurrency=1)
    assert proxy.versions.ready.wait(60)
    post = lambda body: httpx.post(proxy.url + "/atdp/v1/versions", json=body, headers=ADMIN, timeout=300)  # noqa: E731
    try:
        r = post({"checkpoint": str(worse), "name": "perturbed", "wait": True})
        assert r.status_code == 200, r.text
        bad = r.json()
        gate, _safety = bad["gates"]
        n = gate["numbers"]
        print("perturbed:", json.dumps(n["overall"]), json.dumps(n["tenants"]), f"gate {n['seconds']} s")
        assert bad["status"] == "rejected" and gate["state"] == "failed", bad
        assert n["overall"]["serving_mean"] == 1.0 and n["overall"]["candidate_mean"] < 1.0
        # the engine serves the base weights again: the same greedy answers as before
        assert httpx.get(vllm_server.base_url + "/weight_info", timeout=10).json()["weight_version"] == "base"
        assert {p: _greedy(vllm_server.base_url, vllm_server.model, p) for p in PROMPTS} == expected

        r = post({"checkpoint": str(same), "name": "same", "wait": True})
        good = r.json()
        gate, safety = good["gates"]
        assert safety["state"] == "passed" and safety["numbers"]["overall"]["candidate"] == safety["numbers"]["overall"]["serving"]
        n = gate["numbers"]
        print("identical:", json.dumps(n["overall"]), f"gate {n['seconds']} s")
        assert good["status"] == "serving" and gate["state"] == "passed", good
        assert n["overall"]["diff_mean"] == 0.0 and n["overall"]["candidate_mean"] == 1.0
        assert httpx.get(vllm_server.base_url + "/weight_info", timeout=10).json()["weight_version"] == "same"

        back = httpx.post(proxy.url + f"/atdp/v1/versions/{good['id']}/rollback", headers=ADMIN, timeout=120)
        assert back.status_code == 200 and back.json()["name"] == "base", back.text
    finally:
        # The server is shared by the test session: whatever happened, it serves seed 0 again.
        if httpx.get(vllm_server.base_url + "/weight_info", timeout=10).json().get("weight_version") != "base":
            swap_weights(vllm_server.base_url, vllm_server.model_dir, "base")
