"""The host side every kernel family shares, on the CPU: grid arithmetic and split-K counters (`launch`), where the
Triton kernels may run (`triton_device`), and the Hopper GEMMs' split plan (`hopper`)."""
from __future__ import annotations

import pytest
import torch

from nibble.kernels import hopper, launch, triton_device


def test_cdiv_and_next_pow2():
    assert [launch.cdiv(a, 4) for a in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert [launch.next_pow2(x) for x in (0, 1, 2, 3, 4, 5, 576, 4096, 4097)] == [1, 1, 2, 4, 4, 8, 1024, 4096, 8192]


def test_split_counters_grow_for_a_larger_grid_and_are_shared_below_it():
    """A later launch of more tiles than the buffer holds gets a larger one (a kernel counting past its end wrote
    memory it does not own); smaller ones share the first (at least 4096 counters: one allocation per stream)."""
    dev = torch.device("cpu")
    launch._COUNTERS.pop(("cpu", None, 0), None)
    first = launch.split_counters(dev, 10)
    assert first.numel() >= 4096 and first.dtype == torch.int32 and not first.any()
    assert launch.split_counters(dev, 4096) is first
    bigger = launch.split_counters(dev, 5000)
    assert bigger.numel() >= 5000 and launch.split_counters(dev, 10) is bigger
    launch._COUNTERS.pop(("cpu", None, 0), None)


def test_a_device_that_is_not_cuda_has_the_default_sms():
    """The configs' SM count for the Triton interpreter and CPU tests: the H200's. Not only the CPU: a meta device
    (fake tensors, shape-only tracing) asks no GPU either, which a CPU-only torch has none of."""
    assert launch.num_sms(torch.device("cpu")) == launch.NUM_SMS_DEFAULT == 132
    assert launch.num_sms(torch.device("meta")) == launch.NUM_SMS_DEFAULT


def test_the_triton_kernels_take_cpu_tensors_under_the_interpreter_only(monkeypatch):
    x = torch.zeros(2, 8)
    monkeypatch.setattr(triton_device, "interpreting", lambda: True)
    triton_device.check_triton_device(x, "W4A16 Triton")
    monkeypatch.setattr(triton_device, "interpreting", lambda: False)
    with pytest.raises(ValueError, match=r"the W4A16 Triton kernels need CUDA tensors, got device cpu \(or set "
                                         "TRITON_INTERPRET=1"):
        triton_device.check_triton_device(x, "W4A16 Triton")


def test_an_older_triton_without_knobs_reads_triton_interpret(monkeypatch):
    class OldTriton:
        __version__ = "3.1.0"
    monkeypatch.setattr(triton_device, "triton", OldTriton())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_device.interpreting() is True
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert triton_device.interpreting() is False
    monkeypatch.setattr(triton_device, "triton", None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_device.interpreting() is False


def test_split_plan_keeps_every_split_but_the_last_equal():
    """10 stages of 128 in 4 splits: 3 x 3 + 1, never more splits than asked."""
    assert hopper.split_plan(10 * 128, 4) == (4, 3)
    assert hopper.split_plan(10 * 128, 3) == (3, 4)
    assert hopper.split_plan(10 * 128, 6) == (5, 2)  # 6 asked, 2 stages each: 5 remain
    assert hopper.split_plan(4096, 1) == (1, 32) and hopper.split_plan(4096, 0) == (1, 32)
    assert hopper.split_plan(576, 2) == (2, 3)  # SmolLM2's K: 4.5 stages, the partial one a stage too


def test_triton_missing_is_said_with_the_install_command(monkeypatch):
    monkeypatch.setattr(triton_device, "triton", None)
    assert triton_device._triton_unusable() == f"need the `triton` package: pip install 'triton>={triton_device.MIN_TRITON}'"


def test_tiles_side_by_side_need_every_width_but_the_last_a_multiple_of_their_channels():
    tiles = ((128, 256), (128, 128), (64, 128))
    assert hopper.tiles_side_by_side(tiles, [256, 100]) == tiles  # the last width may end in a partial tile
    assert hopper.tiles_side_by_side(tiles, [128, 256, 100]) == ((128, 128), (64, 128))
    assert hopper.tiles_side_by_side(tiles, [100, 256]) == ()


# one tile; a K stage costs 10 us and a split nothing: the model would split wherever it may
_SPLIT_HUNGRY = hopper.CostModel(stage_us={(64, 128): 10.0}, item_us={(64, 128): 1.0}, split_output_us=0.0,
                                 split_us=0.0)


def test_an_unsplit_config_pays_no_split_costs():
    model = hopper.CostModel(stage_us={(64, 128): 1.0}, item_us={(64, 128): 3.0}, split_output_us=2.0, split_us=0.5)
    clusters = hopper.ideal_clusters(132)
    assert model.us(64, 128, 1024, (64, 128), 1, clusters) == pytest.approx(8 * 1.0 + 3.0)
    # two splits: 4 stages each, plus 2.0 per million outputs and split, and 0.5 a split
    assert model.us(64, 128, 1024, (64, 128), 2, clusters) == pytest.approx(4 + 3.0 + 2.0 * 64 * 128 * 2 / 1e6 + 1.0)


def test_pick_config_splits_only_where_each_split_keeps_two_stages():
    clusters = hopper.ideal_clusters(132)
    assert hopper.pick_config(64, 128, 3 * 128, _SPLIT_HUNGRY, clusters)["split_k"] == 1  # 3 stages: 1 a split
    assert hopper.pick_config(64, 128, 4 * 128, _SPLIT_HUNGRY, clusters)["split_k"] == 2
    assert hopper.pick_config(64, 128, 16 * 128, _SPLIT_HUNGRY, clusters)["split_k"] == 8


def test_pick_config_splits_only_where_the_tiles_fit_two_waves():
    """The rule alone, on a made-up GPU that holds 10 clusters of 1 or 2 CTAs and 1 of more: 15 tiles fit two waves of
    clusters of 2 (split there), 21 do not (no split, however cheap the model says it is)."""
    clusters = {1: 10, 2: 10, 3: 1, 4: 1, 6: 1, 8: 1}
    assert hopper.pick_config(64, 15 * 128, 64 * 128, _SPLIT_HUNGRY, clusters)["split_k"] == 2
    assert hopper.pick_config(64, 21 * 128, 64 * 128, _SPLIT_HUNGRY, clusters)["split_k"] == 1
    # the waves of the split's own clusters: 10 clusters of 1, 8 of 2; 16 tiles are two waves exactly, 17 are not
    clusters = {1: 10, 2: 8, 3: 1, 4: 1, 6: 1, 8: 1}
    assert hopper.pick_config(64, 16 * 128, 64 * 128, _SPLIT_HUNGRY, clusters)["split_k"] == 2
    assert hopper.pick_config(64, 17 * 128, 64 * 128, _SPLIT_HUNGRY, clusters)["split_k"] == 1


def test_a_launch_takes_1_to_8_splits_and_one_where_the_config_names_none():
    """The splits of a tile are one cluster, at most 8 CTAs; the error names the launch (``kernel``: the gated GEMM is
    its library under another name). A config of (bn, channels) alone is one split: the launch reads ``split_k`` (it
    raised KeyError there), and the caller's dict is left as it was."""
    from nibble.kernels import w4a4, w4a16

    config = dict(bn=128, channels=128, split_k=8)
    assert w4a16.WGMMA.launch_config(config, 64, 4096, [4096]) == config
    for split in (0, 9):
        with pytest.raises(ValueError, match="^w4a16_wgmma: split_k must be 1 to 8"):
            w4a16.WGMMA.launch_config(dict(config, split_k=split), 64, 4096, [4096])
    with pytest.raises(ValueError, match="^w4a16_wgmma_silu_mul: split_k"):
        w4a16.WGMMA.launch_config(dict(config, split_k=9), 64, 4096, [4096], kernel="w4a16_wgmma_silu_mul")
    for gemm in (w4a16.WGMMA, w4a4.WGMMA):
        config = dict(bn=128, channels=128)
        assert gemm.launch_config(config, 64, 4096, [4096]) == dict(bn=128, channels=128, split_k=1)
        assert config == dict(bn=128, channels=128)


def test_a_launch_over_several_weights_is_configured_for_their_columns_together():
    from nibble.kernels import w4a16

    for M, widths, K in ((128, [1024, 1024, 1024], 4096), (64, [4096] * 3, 4096), (256, [2048, 2048], 8192)):
        together = w4a16.WGMMA.config(M, sum(widths), K, widths=widths)
        assert w4a16.WGMMA.launch_config(None, M, K, widths) == together
        assert together != w4a16.WGMMA.config(M, widths[0], K, widths=widths)  # the first weight's alone differs


def test_the_triton_kernels_take_cuda_tensors_whether_interpreting_or_not(monkeypatch):
    """The interpreter only adds CPU tensors: a CUDA tensor (a fake one here) is taken either way."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from conftest import fake_cuda

    (x,) = fake_cuda(FakeTensorMode(), torch.zeros(2, 8))
    for interpreting in (False, True):
        monkeypatch.setattr(triton_device, "interpreting", lambda: interpreting)
        triton_device.check_triton_device(x, "W4A16 Triton")


def test_a_triton_with_programmatic_dependent_launch_is_usable():
    """The triton installed here has gdc_wait (3.4 and later): nothing to say, and the kernels run."""
    cuda = pytest.importorskip("triton.language.extra.cuda")
    if not (hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")):
        pytest.skip("this triton predates programmatic dependent launch")
    assert triton_device._triton_unusable() is None and triton_device.TRITON_UNUSABLE is None


@pytest.mark.parametrize("value", ["", "0", None])
def test_an_older_triton_is_not_interpreting_with_triton_interpret_empty_or_unset(monkeypatch, value):
    """Triton's own reading before its knobs: "1" only. An empty TRITON_INTERPRET (``TRITON_INTERPRET= pytest``) is
    the compiled kernels, as it is for triton."""
    class OldTriton:
        __version__ = "3.1.0"
    monkeypatch.setattr(triton_device, "triton", OldTriton())
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_device.interpreting() is False


def test_ideal_clusters_are_whole_clusters_of_each_split():
    """Where no GPU was asked: every SM in some cluster, whole clusters only (132 SMs hold 16 clusters of 8, not
    16.5)."""
    assert hopper.ideal_clusters(132) == {1: 132, 2: 66, 3: 44, 4: 33, 6: 22, 8: 16}


def test_the_model_counts_whole_waves_and_the_stages_of_the_longest_split():
    """A wave per ``clusters[split]`` tiles, the last one partial; each wave pays the K stages of one split, rounded
    up (10 stages in 4 splits: 3, as `split_plan` makes them), and the tile's fixed cost."""
    model = hopper.CostModel(stage_us={(64, 128): 1.0}, item_us={(64, 128): 3.0}, split_output_us=0.0, split_us=0.0)
    clusters = {1: 4, 2: 2, 3: 1, 4: 1, 6: 1, 8: 1}
    # 5 tiles, 4 clusters: two waves of 10 stages each
    assert model.us(64, 5 * 128, 10 * 128, (64, 128), 1, clusters) == pytest.approx(2 * (10 + 3.0))
    # in 4 splits: one cluster of 4 at a time, so 5 waves of 3 stages
    assert model.us(64, 5 * 128, 10 * 128, (64, 128), 4, clusters) == pytest.approx(5 * (3 + 3.0))
    assert hopper.split_plan(10 * 128, 4)[1] == 3


def test_a_hopper_gemm_asks_its_own_library_for_its_clusters_once_per_device(monkeypatch):
    """`WgmmaGemm.lib` is `cuda_build.library` with the GEMM's signatures; `clusters` asks the GEMM's own
    ``nibble_<name>_clusters`` (the two GEMMs' CTAs differ), once per device, a device named by a string too."""
    import contextlib
    import types

    from nibble.kernels import cuda_build

    def signatures(lib):
        pass
    asked = []

    def query(sms):
        def clusters(split, out):
            asked.append(split)
            out._obj.value = sms // split
            return 0
        return clusters
    libs = {"w4a4_wgmma": types.SimpleNamespace(nibble_w4a4_wgmma_clusters=query(132)),
            "w4a16_wgmma": types.SimpleNamespace(nibble_w4a16_wgmma_clusters=query(114))}
    monkeypatch.setattr(cuda_build, "library", lambda name, device, configure: configure is signatures and libs[name])
    monkeypatch.setattr(cuda_build, "_ASKED", {})
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    w4a4, w4a16 = (hopper.WgmmaGemm(name, signatures, _SPLIT_HUNGRY) for name in ("w4a4_wgmma", "w4a16_wgmma"))
    assert w4a4.lib(torch.device("cuda", 0)) is libs["w4a4_wgmma"]
    assert w4a4.clusters("cuda:0") == hopper.ideal_clusters(132) == w4a4.clusters(torch.device("cuda", 0))
    assert w4a16.clusters("cuda:0") == hopper.ideal_clusters(114)
    assert asked == list(hopper.SPLITS) * 2


def test_a_launch_is_configured_for_the_gpus_clusters():
    """With no config given, a launch's config is `config`'s for the clusters the GPU holds (the H200's 39 clusters
    of 3 and 30 of 4 at 128 tokens: 3 splits), not those of an ideal GPU (4 splits)."""
    from nibble.kernels import w4a16

    h200 = {1: 132, 2: 66, 3: 39, 4: 30, 6: 17, 8: 15}
    picked = w4a16.WGMMA.launch_config(None, 128, 4096, [4096], h200)
    assert picked == w4a16.WGMMA.config(128, 4096, 4096, h200) == dict(bn=128, channels=128, split_k=3)
    assert w4a16.WGMMA.launch_config(None, 128, 4096, [4096])["split_k"] == 4


def test_tile_count_counts_partial_tiles():
    """A last tile of fewer tokens or channels is a tile (65 tokens in 64-token tiles: 2; 1152 channels in 256: 5)."""
    assert hopper.tile_count(65, 1152, 64, 256) == 2 * 5
    assert hopper.tile_count(64, 1024, 64, 256) == 1 * 4


def test_pick_config_chooses_among_the_tiles_given():
    """``tiles`` (those a side-by-side launch can run) limits the choice, even where the model prefers another."""
    model = hopper.CostModel(stage_us={(64, 128): 10.0, (64, 256): 1.0}, item_us={(64, 128): 1.0, (64, 256): 1.0},
                             split_output_us=0.0, split_us=0.0)
    clusters = hopper.ideal_clusters(132)
    assert hopper.pick_config(64, 4096, 4096, model, clusters)["channels"] == 256
    assert hopper.pick_config(64, 4096, 4096, model, clusters, tiles=((64, 128),))["channels"] == 128


def test_a_config_for_weights_side_by_side_takes_a_tile_they_allow():
    """A 4224-wide weight first (33 x 128) rules out 256-channel tiles, which the same columns alone would take."""
    from nibble.kernels import w4a4

    widths = [4224, 4096, 4096]
    assert w4a4.WGMMA.config(1024, sum(widths), 4096)["channels"] == 256
    assert w4a4.WGMMA.config(1024, sum(widths), 4096, widths=widths)["channels"] == 128
    assert w4a4.WGMMA.launch_config(None, 1024, 4096, widths)["channels"] == 128
