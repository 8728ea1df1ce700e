"""Attention shapes of the DeepSeek-V4 models (spec section 1), as named presets."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from planner.batch import LayerKind, layer_kind


def _interleaved(first: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """`first` bootstrap layers, then CSA on even and HCA on odd layers, then the MTP layer (SWA)."""
    rest = tuple(4 if i % 2 == 0 else 128 for i in range(len(first), num_layers))
    return first + rest + (0,)


@dataclass(frozen=True)
class ModelShape:
    """What attention planning needs of a model; `compress_ratios` ends with the MTP layer."""

    name: str
    num_heads: int
    head_dim: int
    window_size: int
    index_topk: int
    compress_ratios: tuple[int, ...]

    @classmethod
    def from_name(cls, name: str) -> "ModelShape":
        key = name.lower().replace("_", "-")
        if key not in PRESETS:
            raise ValueError(f"name: expected one of {sorted(p.name for p in PRESETS.values())}, got {name!r}")
        return PRESETS[key]

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    def layers_per_kind(self) -> dict[LayerKind, int]:
        counts = Counter(layer_kind(r) for r in self.compress_ratios)
        return {k: counts.get(k, 0) for k in LayerKind}


PRESETS = {
    "v4-flash": ModelShape("V4-Flash", 64, 512, 128, 512, _interleaved((0, 0), 43)),
    "v4-pro": ModelShape("V4-Pro", 128, 512, 128, 1024, _interleaved((128, 128), 61)),
}
