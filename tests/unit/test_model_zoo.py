"""Locally built test models: deterministic, idempotent, and usable by both transformers and vLLM."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from proxy.demo import model_zoo


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.name != model_zoo.MARKER
    }


def _greedy(folder: Path, messages: list[dict], n: int = 8) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    x = torch.tensor([list(ids)])
    out = model.generate(x, max_new_tokens=n, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return out[0, x.shape[1] :].tolist()


def test_tiny_model_is_deterministic_and_idempotent(tmp_path):
    a = model_zoo.build_tiny_model(tmp_path / "a", seed=0)
    b = model_zoo.build_tiny_model(tmp_path / "b", seed=0)
    assert _digest(a) == _digest(b)
    assert json.loads((a / model_zoo.MARKER).read_text())["seed"] == 0

    before = (a / "model.safetensors").stat().st_mtime_ns
    assert model_zoo.build_tiny_model(a, seed=0) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == before  # not rebuilt

    # A folder holding another seed (or an interrupted build) is replaced, not trusted.
    model_zoo.build_tiny_model(a, seed=1)
    assert _digest(a)["model.safetensors"] != _digest(b)["model.safetensors"]
    assert not list(tmp_path.glob(".a.*"))  # no temporary folders left behind


def test_tiny_model_shape_and_tokenizer(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    folder = model_zoo.build_tiny_model(tmp_path / "m", seed=0)
    config = AutoConfig.from_pretrained(folder)
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (128, 2, 1)
    assert config.hidden_size // config.num_attention_heads == 64  # vLLM's CPU kernel needs 64
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == config.vocab_size == model_zoo.TINY_VOCAB_SIZE
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    # Byte-level: any text round-trips, including non-ASCII.
    text = "Grüße, 世界! tabs\tand\nnewlines"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_seeds_give_different_greedy_outputs(tmp_path):
    messages = [{"role": "user", "content": "Hello there"}]
    s0 = _greedy(model_zoo.build_tiny_model(tmp_path / "s0", seed=0), messages)
    s1 = _greedy(model_zoo.build_tiny_model(tmp_path / "s1", seed=1), messages)
    assert s0 != s1


def test_chat_template_renders_tools_and_tool_calls(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_zoo.build_tiny_model(tmp_path / "m", seed=0))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou may call these tools:\n<tools>\n")
    assert text.count("<|im_start|>system") == 1
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    )
    assert "<|im_start|>user\nWeather in Paris?<|im_end|>" in text
    assert text.endswith("<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n")


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("ATDP_HOME", str(tmp_path))
    assert model_zoo.default_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("ATDP_HOME")
    assert model_zoo.default_cache_dir() == Path.home() / ".cache" / "atdp" / "models"


@pytest.mark.slow
def test_smollm2_converts_and_answers():
    folder = model_zoo.cached_smollm2()  # about 20 s the first time, cached afterwards
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == "llama" and config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    answer = _greedy(folder, [{"role": "user", "content": "What is the capital of France?"}], n=8)
    assert "Paris" in tokenizer.decode(answer)
