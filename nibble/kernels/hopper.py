"""What the two Hopper GEMMs (``csrc/w4a16_wgmma.cu``, ``csrc/w4a4_wgmma.cu``) share on the Python
side: how many CTAs a tile shape makes, the choice of tile and split-K by a small cost model, and
`WgmmaGemm`, each one's library, resident clusters and configs (``w4a16.WGMMA``, ``w4a4.WGMMA``).

A CTA computes ``tokens x channels`` outputs over its share of K, in stages of 128. The model
(`CostModel`), fitted per kernel to an H200 sweep (``benchmarks/scripts/w4a16_wgmma_sweep.py`` /
``w4a4_explore.py``; the fit also has a fixed cost per launch, which no choice changes): per wave
of tiles the K stages of a split times the tile's time per stage plus the tile's fixed cost per
item (pipeline ramp, epilogue), and for split-K a cost per split and per million outputs and split
(partials stored, then each split's CTA sums its share of the tile's rows). The splits of a tile
run as one thread-block cluster, whose CTAs share a GPC: a wave holds as many tiles as clusters of
that size fit on the GPU at once (``clusters``, measured by the kernels' libraries), which is fewer
than SMs / split. Within a few percent of the best measured config on the shapes swept
(``benchmarks/notes-*.md``).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from nibble.kernels import cuda_build
from nibble.kernels.launch import NUM_SMS_DEFAULT, cdiv

STAGE_K = 128  # K per pipeline stage in both kernels
SPLITS = (1, 2, 3, 4, 6, 8)
MAX_SPLIT = 8  # the largest portable thread-block cluster


def tile_count(M: int, N: int, tokens: int, channels: int) -> int:
    """Output tiles (CTAs per split) of a ``tokens x channels`` CTA shape."""
    return cdiv(M, tokens) * cdiv(N, channels)


def split_plan(K: int, split_k: int) -> tuple[int, int]:
    """(splits, K stages per split) for a requested split-K: every split but the last gets the same
    number of stages, so fewer splits than asked may remain (10 stages in 4 splits: 3 x 3 + 1)."""
    k_stages = cdiv(K, STAGE_K)
    per_split = cdiv(k_stages, max(1, int(split_k)))
    return cdiv(k_stages, per_split), per_split


def ideal_clusters(num_sms: int) -> dict:
    """{split: clusters of that many CTAs resident at once} if every SM could take part (where no
    GPU was asked: CPU tests, the fit of an old sweep)."""
    return {split: num_sms // split for split in SPLITS}


def resident_clusters(query) -> dict:
    """{split: clusters resident at once} from a kernel library's ``nibble_*_wgmma_clusters(splits,
    int *clusters)`` on the current device (one CTA per SM; split 1: the SMs)."""
    out = {}
    for split in SPLITS:
        n = ctypes.c_int(0)
        err = query(split, ctypes.byref(n))
        if err or n.value < 1:
            raise RuntimeError(f"cannot size clusters of {split} CTAs on this GPU (CUDA error {err})")
        out[split] = n.value
    return out


def tiles_side_by_side(tiles, widths) -> tuple:
    """The CTA shapes of ``tiles`` that one launch over weights of ``widths`` columns side by side
    can run (both GEMMs' ``*_wgmma_many``): a tile never spans two weights, so every width but the
    last must be a multiple of its channels."""
    return tuple(tile for tile in tiles if all(n % tile[1] == 0 for n in widths[:-1]))


@dataclass(frozen=True)
class CostModel:
    """Modelled microseconds of a config (see the module docstring); ``stage_us`` names the tiles."""
    stage_us: dict       # (tokens, channels) -> one 128-deep K stage of one CTA
    item_us: dict        # (tokens, channels) -> a CTA's fixed cost per output tile
    split_output_us: float  # per million outputs and split, split-K only
    split_us: float         # per split, split-K only
    # (tokens, channels) -> the most tokens the tile was swept at: above, the fit says nothing of
    # it, and `pick_config` leaves it out (tiles not named: no bound)
    max_tokens: dict = field(default_factory=dict)

    def us(self, M: int, N: int, K: int, tile: tuple, split: int, clusters: dict) -> float:
        """``clusters``: {split: clusters resident at once} (`ideal_clusters`, `resident_clusters`)."""
        waves = cdiv(tile_count(M, N, *tile), clusters[split])
        t = waves * (cdiv(cdiv(K, STAGE_K), split) * self.stage_us[tile] + self.item_us[tile])
        return t + (self.split_output_us * M * N * split / 1e6 + self.split_us * split if split > 1 else 0.0)


def pick_config(M: int, N: int, K: int, model: CostModel, clusters: dict, tiles=None) -> dict:
    """The (tokens, channels) of ``model`` (or of ``tiles``, a subset) and the split-K of least
    modelled time on a GPU that holds ``clusters`` ({split: clusters resident at once}; a pure
    function): split only where each split keeps 2 stages and the tiles fit two waves, and no tile
    above the tokens it was swept at (``model.max_tokens``)."""
    k_stages = cdiv(K, STAGE_K)
    shapes = [(tile, split) for tile in (model.stage_us if tiles is None else tiles)
              if M <= model.max_tokens.get(tile, M) for split in SPLITS
              if split == 1 or (k_stages // split >= 2 and tile_count(M, N, *tile) <= 2 * clusters[split])]
    (tokens, channels), split = min(shapes, key=lambda c: model.us(M, N, K, *c, clusters))
    return dict(bn=tokens, channels=channels, split_k=split)


class WgmmaGemm:
    """The host side of one Hopper GEMM, ``csrc/<name>.cu``: its library (``signatures``: its
    `cuda_build.signatures`), the clusters of its CTAs a GPU holds, and its tiles and configs by its
    fitted ``model``, whose tiles are the ones the library is compiled for."""

    def __init__(self, name: str, signatures, model: CostModel):
        self.name, self.signatures, self.model = name, signatures, model

    def lib(self, device):
        """The compiled kernel for ``device``, or None (see ``cuda_build.library``)."""
        return cuda_build.library(self.name, device, self.signatures)

    def clusters(self, device) -> dict:
        """{split: clusters of the kernel's CTAs resident at once} on ``device`` (`resident_clusters`,
        asked once per device)."""
        device = torch.device(device)
        return cuda_build.ask_once(f"{self.name} clusters", device, lambda: resident_clusters(
            getattr(self.lib(device), f"nibble_{self.name}_clusters")))

    def tiles(self, widths=None) -> tuple:
        """The CTA shapes (tokens, channels) of the kernel; with ``widths``, those one launch over
        weights of these widths side by side can run (`tiles_side_by_side`)."""
        tiles = tuple(self.model.stage_us)
        return tiles if widths is None else tiles_side_by_side(tiles, widths)

    def config(self, M: int, N: int, K: int, clusters: dict | None = None, widths=None) -> dict:
        """CTA tile (bn tokens x channels) and split-K (`pick_config`) for N columns, or for weights
        of ``widths`` columns side by side in one launch, on a GPU that holds ``clusters``
        (`clusters`; default: NUM_SMS_DEFAULT SMs, every one usable)."""
        return pick_config(M, N, K, self.model, clusters or ideal_clusters(NUM_SMS_DEFAULT), self.tiles(widths or None))

    def launch_config(self, config, M: int, K: int, widths, clusters: dict | None = None,
                      kernel: str | None = None) -> dict:
        """The config of one launch (``kernel`` names it in errors; default: the library's name) over weights of
        ``widths`` columns side by side: ``config`` (bn, channels, split_k; one split where it names none) as given,
        else `config`'s; either way a tile the widths allow (`tiles`) and 1 to MAX_SPLIT splits, or a ValueError that
        names what is allowed."""
        kernel = kernel or self.name
        if config is not None:
            config = {"split_k": 1, **config}  # the launches read cfg["split_k"]; the caller's dict is left as it is
        tiles = self.tiles(widths)
        tile = None if config is None else (config["bn"], config["channels"])
        if not tiles or (tile is not None and tile not in tiles):
            raise ValueError(f"{kernel}: (bn, channels) must be one of {tiles} for weights of widths {list(widths)} "
                             f"(each but the last a multiple of the channels), got {tile or 'none that fits'}")
        if config is not None and not 1 <= int(config["split_k"]) <= MAX_SPLIT:
            raise ValueError(f"{kernel}: split_k must be 1 to {MAX_SPLIT} (the splits of a tile are one cluster of "
                             f"CTAs, at most {MAX_SPLIT}), got {config['split_k']}")
        return config if config is not None else self.config(M, sum(widths), K, clusters, widths)
