"""Write an HF model directory (safetensors + tokenizer) from a GGUF file, for vLLM, which wants one.

Runs in the vLLM venv (its transformers), not the project's: `VENV/bin/python bench/vllm_hf_dir.py GGUF OUT`.
transformers dequantizes the GGUF's Q4_1 tensors (GgufConfig(dequantize=True)) and saves bf16 weights, so
both servers run the same numbers up to the two loaders' dequantization.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig


def main(gguf: Path, out: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
        dtype=torch.bfloat16,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
