"""What the two Hopper GEMMs (``csrc/w4a16_wgmma.cu``, ``csrc/w4a4_wgmma.cu``) share on the Python
side: how many CTAs a tile shape makes, and the choice of tile and split-K by a small cost model.

A CTA computes ``tokens x channels`` outputs over its share of K, in stages of 128. The model,
fitted per kernel to an H200 sweep (``benchmarks/scripts/*_sweep.py`` / ``w4a4_explore.py``):
waves of CTAs x K stages per split x the measured time of one stage for the tile shape, plus a
cost per split-K partial (stored, then summed by the last CTA) per million outputs. Within a few
percent of the best measured config on the shapes swept (``benchmarks/notes-*.md``).
"""
from __future__ import annotations

STAGE_K = 128  # K per pipeline stage in both kernels
SPLITS = (1, 2, 3, 4, 6, 8)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_count(M: int, N: int, tokens: int, channels: int) -> int:
    """Output tiles (CTAs per split) of a ``tokens x channels`` CTA shape."""
    return _cdiv(M, tokens) * _cdiv(N, channels)


def split_plan(K: int, split_k: int) -> tuple[int, int]:
    """(splits, K stages per split) for a requested split-K: every split but the last gets the same
    number of stages, so fewer splits than asked may remain (10 stages in 4 splits: 3 x 3 + 1)."""
    k_stages = _cdiv(K, STAGE_K)
    per_split = _cdiv(k_stages, max(1, int(split_k)))
    return _cdiv(k_stages, per_split), per_split


def pick_config(M: int, N: int, K: int, stage_us: dict, split_us: float, num_sms: int) -> dict:
    """The (tokens, channels) of ``stage_us`` and the split-K of least modelled time (a pure
    function): split only where each split keeps 2 stages and the CTAs fit two waves."""
    k_stages = _cdiv(K, STAGE_K)

    def modelled_us(tile: tuple, split: int) -> float:
        ctas = tile_count(M, N, *tile) * split
        return (_cdiv(ctas, num_sms) * _cdiv(k_stages, split) * stage_us[tile]
                + (split_us * M * N * split / 1e6 if split > 1 else 0.0))

    shapes = [(tile, split) for tile in stage_us for split in SPLITS
              if split == 1 or (k_stages // split >= 2 and tile_count(M, N, *tile) * split <= 2 * num_sms)]
    (tokens, channels), split = min(shapes, key=lambda c: modelled_us(*c))
    return dict(bn=tokens, channels=channels, split_k=split)
