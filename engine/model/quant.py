"""Quantized weights: GGUF's Q8_0, Q4_0 and Q4_1 blocks kept as they ship, packed for the CPU kernel
(engine/model/csrc/qlinear.cpp), and the `--quantization` choice.

Why keep them quantized: a decode step reads every weight once, so its time is the weights' bytes over the
memory rate. The default GGUF's Q4_1 linears and Q8_0 embedding are 98 MB; dequantized to bf16 they are 270 MB,
to fp32 540 MB. llama.cpp reads the 98 MB, and at one stream is several times faster than a dequantized model.

A packed weight is a uint8 tensor [N/16, K/32, record] (qlinear.cpp lays a record out), which says all the
kernel needs: N, K, and the width (a 320-byte record is 4-bit, a 544-byte one 8-bit). The model keeps it
where the float weight would be (engine/model/llama.py), so the model cache stores it as it is.
Q4_0 is packed as Q4_1 with the minimum -8 d (exact in f16), so one 4-bit kernel runs both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.config import QUANTIZATIONS

QK = 32  # weights per GGUF block
OUT_BLOCK = 16  # outputs per packed block
RECORD_BYTES = {4: 4 * OUT_BLOCK + OUT_BLOCK * QK // 2, 8: 2 * OUT_BLOCK + OUT_BLOCK * QK}
BITS_OF_RECORD = {v: k for k, v in RECORD_BYTES.items()}
# type -> (bytes per GGUF block, bits in the packed record)
KINDS = {"q8_0": (34, 8), "q4_0": (18, 4), "q4_1": (20, 4)}
AUTO, NONE, AS_SHIPPED = "auto", "none", "gguf"
assert (AUTO, NONE, *KINDS) == QUANTIZATIONS  # the flag's choices (engine/config.py) are these


@dataclass(frozen=True)
class RawQuant:
    """A weight [rows, K] in GGUF blocks, as the file holds it: [rows, K / 32 * block bytes] bytes."""

    data: np.ndarray
    kind: str

    def floats(self) -> np.ndarray:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        kind = GGMLQuantizationType[self.kind.upper()]
        return np.asarray(dequantize(self.data, kind), np.float32).reshape(self.data.shape[0], -1)


def concat(parts: list[RawQuant]) -> RawQuant:
    """Fused rows (q/k/v, gate/up), as one weight: the parts must share a type."""
    return RawQuant(np.concatenate([p.data for p in parts]), parts[0].kind)


def quantize(w: np.ndarray, kind: str) -> RawQuant:
    """A float weight [N, K] in GGUF blocks of `kind`, rounded as llama.cpp's reference quantizers round."""
    blocks = w.astype(np.float32).reshape(w.shape[0], -1, QK)
    if kind == "q8_0":
        d = np.abs(blocks).max(-1, keepdims=True) / 127
        q = np.round(blocks / np.where(d == 0, 1, d)).astype(np.int8)
        return _raw([d, q.view(np.uint8)], kind, w.shape[0])
    if kind == "q4_0":  # the signed extreme maps to -8
        ext = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)
        d = ext / -8
        q = np.clip(np.floor(blocks / np.where(d == 0, 1, d) + 8.5), 0, 15).astype(np.uint8)
        return _raw([d, q[..., :16] | (q[..., 16:] << 4)], kind, w.shape[0])
    lo, hi = blocks.min(-1, keepdims=True), blocks.max(-1, keepdims=True)
    d = (hi - lo) / 15
    q = np.clip(np.round((blocks - lo) / np.where(d == 0, 1, d)), 0, 15).astype(np.uint8)
    return _raw([d, lo, q[..., :16] | (q[..., 16:] << 4)], kind, w.shape[0])


def _raw(fields: list[np.ndarray], kind: str, rows: int) -> RawQuant:
    """GGUF blocks from their fields: f16 scales (as bytes), then the quants."""
    parts = [f.astype(np.float16).view(np.uint8) if f.dtype == np.float32 else f for f in fields]
    return RawQuant(np.concatenate(parts, -1).reshape(rows, -1), kind)


def pack(raw: RawQuant) -> torch.Tensor:
    """`raw` in the kernel's layout (qlinear.cpp): [N/16, K/32, record] uint8. Raises ValueError where the shape
    does not fit (N a multiple of 16)."""
    n = raw.data.shape[0]
    if not packable(n):
        raise ValueError(f"a quantized linear needs a multiple of {OUT_BLOCK} outputs, this one has {n}")
    block_bytes, _ = KINDS[raw.kind]
    b = raw.data.reshape(n // OUT_BLOCK, OUT_BLOCK, -1, block_bytes)  # [ob, lane, kb, bytes]
    nb, kb = b.shape[0], b.shape[2]

    def lanes(x: np.ndarray) -> np.ndarray:  # [ob, lane, kb, bytes] -> [ob, kb, lane-major bytes]
        return np.moveaxis(x, 1, 2).reshape(nb, kb, -1)

    def chunks(x: np.ndarray, count: int) -> np.ndarray:  # [ob, lane, kb, bytes] -> [ob, kb, chunk, lane, 4]
        return x.reshape(nb, OUT_BLOCK, kb, count, 4).swapaxes(1, 3).swapaxes(1, 2).reshape(nb, kb, -1)

    if raw.kind == "q8_0":  # chunk g, lane n: inputs 4g..4g+3 of output n
        fields = [lanes(b[..., 0:2]), chunks(b[..., 2:], 8)]
    else:  # chunk c, lane n: GGUF bytes 4c..4c+3 of output n (inputs 4c.. low nibbles, 16+4c.. high)
        d = b[..., 0:2]
        m = b[..., 2:4] if raw.kind == "q4_1" else (d.copy().view(np.float16) * np.float16(-8)).view(np.uint8)
        fields = [lanes(d), lanes(m), chunks(b[..., -16:], 4)]
    out = np.concatenate(fields, -1)
    return torch.from_numpy(np.ascontiguousarray(out))


def packable(rows: int) -> bool:
    return rows % OUT_BLOCK == 0


def is_packed(w: torch.Tensor) -> bool:
    return w.dtype == torch.uint8


def packed_shape(w: torch.Tensor) -> tuple[int, int, int]:
    """(out_features, in_features, bits) of a packed weight."""
    return w.shape[0] * OUT_BLOCK, w.shape[1] * QK, BITS_OF_RECORD[w.shape[2]]


@dataclass(frozen=True)
class QuantChoice:
    mode: str | None  # None: float weights; AS_SHIPPED: GGUF-quantized tensors kept; else every linear in this type
    reason: str


def choose_quantization(requested: str, device: torch.device, kernel_blocker: str | None) -> QuantChoice:
    """What `--quantization` means here. `kernel_blocker`: why the quantized CPU kernels cannot run (None:
    they can). auto keeps a GGUF's quantized tensors as they ship wherever the kernels run; none dequantizes;
    a type quantizes every linear to it (from the float weights). Raises ValueError when a type is asked for
    where the kernels cannot run."""
    if requested not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {requested!r}: use one of {', '.join(QUANTIZATIONS)}")
    if requested == NONE:
        return QuantChoice(None, "none, as asked: weights dequantized")
    if device.type != "cpu":
        blocker = f"the quantized kernels are CPU kernels, device is {device.type}"
    else:
        blocker = kernel_blocker
    if requested == AUTO:
        if blocker is not None:
            return QuantChoice(None, f"auto: weights dequantized ({blocker})")
        return QuantChoice(AS_SHIPPED, "auto: GGUF-quantized weights served as they ship (Q8_0/Q4_0/Q4_1)")
    if blocker is not None:
        raise ValueError(f"quantization {requested} cannot run: {blocker}")
    return QuantChoice(requested, f"{requested}, as asked: every linear quantized to it")
