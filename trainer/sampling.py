"""The distribution a token was sampled from: temperature, top-k, top-p, as vLLM applies them.

Agents sample at temperature != 1 or top_p < 1. The importance ratio pi_theta(y) / pi_b(y) is only
right when both sides are the *processed* distribution the token was drawn from. vLLM reports that
distribution with `--logprobs-mode processed_logprobs`; this module recomputes it on the trainer's
side from each step's recorded sampling parameters, in vLLM's order (vllm/v1/sample/sampler.py and
ops/topk_topp_sampler.py, 0.32):

    logits (fp32) / T  ->  top-k: logits below the k-th largest = -inf
                       ->  top-p: sort ascending, mask where cumsum(softmax) <= 1 - p (the largest
                           always stays)  ->  log_softmax

A greedy request (T == 0) is processed as T = 1 with no top-k/top-p (vLLM returns its raw
logprobs), so its ratio is against the raw distribution, as before.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

log = logging.getLogger("atdp.trainer")

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off

    @property
    def plain(self) -> bool:
        """True when the processed distribution is the raw one."""
        return self.temperature == 1.0 and self.top_p >= 1.0 and self.top_k <= 0


PLAIN = Sampling()


def from_params(params: Mapping[str, object] | None) -> Sampling:
    """A step's sampling, from the parameters the client sent (all three doors use these names).

    Missing values are the engine's defaults (1, 1, off); the proxy's launchers start vLLM with
    `--generation-config vllm` so a model's own generation_config cannot change them unseen."""
    params = params or {}

    def num(key: str, default: float) -> float:
        value = params.get(key)
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        return float(value) if ok else default

    temperature = num("temperature", 1.0)
    if temperature < GREEDY_EPS:
        return PLAIN
    top_p = num("top_p", 1.0)
    top_k = int(num("top_k", 0.0))
    return Sampling(temperature=temperature, top_p=min(max(top_p, 0.0), 1.0), top_k=max(top_k, 0))


def processed_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor
) -> torch.Tensor:
    """log p_processed(targets) for rows of fp32 logits [N, V]; temperature/top_p [N] float, top_k [N] long."""
    logits = logits / temperature.unsqueeze(1)
    vocab = logits.shape[1]
    ascending, order = logits.sort(dim=-1)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = ascending.gather(1, (vocab - k).unsqueeze(1))  # the k-th largest logit of each row
    ascending = ascending.masked_fill(ascending < kth, -math.inf)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    outside = cumulative <= (1 - top_p).unsqueeze(1)
    outside[:, -1] = False  # the most likely token always stays
    ascending = ascending.masked_fill(outside, -math.inf)
    processed = torch.empty_like(logits).scatter_(1, order, ascending)
    return processed.log_softmax(dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)


def engine_logprobs_mode(engine_url: str, *, api_key: str | None = None, timeout: float = 60.0) -> str:
    """"processed" when the engine reports logprobs after temperature/top-p (`--logprobs-mode
    processed_logprobs`), else "raw": the most likely first token's logprob is the same at
    temperature 1 and 0.5 only when the engine reports the raw distribution."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=engine_url.rstrip("/"), headers=headers, timeout=timeout) as client:
        served = client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        top = []
        for temperature in (1.0, 0.5):
            body = client.post("/v1/chat/completions", json={
                "model": served, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 1,
                "temperature": temperature, "seed": 0, "logprobs": True, "top_logprobs": 1,
            }).raise_for_status().json()  # fmt: skip
            top.append(body["choices"][0]["logprobs"]["content"][0]["top_logprobs"][0]["logprob"])
    return "processed" if abs(top[0] - top[1]) > 1e-3 else "raw"


def resolve_logprobs_mode(setting: str, engine_url: str | None, *, api_key: str | None = None) -> str:
    """`--behaviour-logprobs`: raw | processed as given; auto asks the engine (raw if it cannot)."""
    if setting not in ("auto", "raw", "processed"):
        raise ValueError(f"behaviour logprobs {setting!r}: expected auto, raw or processed")
    mode = setting
    if mode == "auto":
        mode = "raw"
        if engine_url:
            try:
                mode = engine_logprobs_mode(engine_url, api_key=api_key)
            except Exception as e:  # an unreachable engine must not stop training; say why
                log.warning("behaviour logprobs: asking %s failed (%s); assuming raw", engine_url, type(e).__name__)
    if mode == "raw":
        log.warning("behaviour logprobs: raw; steps sampled at temperature != 1 or with top-p/top-k are weighted "
                    "against the raw distribution (start vLLM with --logprobs-mode processed_logprobs)")
    else:
        log.info("behaviour logprobs: processed (each step recomputed with its own sampling)")
    return mode
