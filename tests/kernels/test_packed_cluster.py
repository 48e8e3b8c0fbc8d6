"""`kernels.packed_cluster`'s launch rule, its CUDA source and its refusals, on the CPU (the kernel
itself: tests/gpu/test_packed_cluster_gpu.py)."""

from __future__ import annotations

import re

import pytest
import torch

from fp4kit.kernels import packed_cluster as pc
from fp4kit.kernels import packed_gemm as pg
from fp4kit.kernels import packed_linear as pl
from fp4kit.kernels.quantize import quantize


def test_mma_rows_round_up_to_8():
    assert [pc.mma_rows(m) for m in (1, 8, 9, 16, 17, 33, 40, 41, 49, 64)] == [8, 8, 16, 16, 24, 40, 40, 48, 56, 64]


def test_config_splits_k_where_the_busiest_multiprocessor_takes_least():
    # 132 multiprocessors: 58 column blocks of 64 weight rows on 3712 x 2688 (21 K tiles), 42 on
    # 2688 x 3712 (29); four warpgroups a block, one block a multiprocessor at a time, each block
    # BLOCK_TILES (4) tiles' worth besides its own
    assert pc.config(32, 3712, 2688, sms=132) == {"BN": 32, "CL": 2, "WG": 4, "WN": 1, "STAGES": 3, "PF": 2,
                                                  "DB": 1, "PDL": 1}
    # above WG4_ROWS (32) rows two shares of K a block: 3712 x 2688, CL 1: 11 + 4, CL 2: 6 + 4,
    # CL 4: 2 * (3 + 4)
    assert pc.config(33, 3712, 2688, sms=132) == {"BN": 40, "CL": 2, "WG": 2, "WN": 1, "STAGES": 3, "PF": 2,
                                                  "DB": 1, "PDL": 1}
    # 3712 x 2688: CL 1: 6 + 4; CL 2 (116 blocks): 3 + 4; CL 4 (232 blocks, two waves): 2 * (2 + 4)
    cost = {q: -(-58 * q // 132) * (-(-21 // (4 * q)) + pc.BLOCK_TILES) for q in pc.CLUSTERS}
    assert cost == {1: 10, 2: 7, 4: 12, 8: 20}
    # 2688 x 3712: CL 8 would run 3 waves of one tile each (3 * 5) against CL 2's 4 + 4
    assert [pc.config(m, 2688, 3712, sms=132)["CL"] for m in (16, 20, 64)] == [2, 2, 2]
    # ties go to the smaller cluster: one K tile is one warpgroup's work however many blocks share it
    assert pc.config(16, 64, 128, sms=132)["CL"] == 1
    assert pc.config(16, 64, 1024, sms=132)["CL"] == 2  # 8 tiles: CL 2 takes 1 + 4, CL 1 2 + 4
    assert pc.config(16, 3712, 2688)["CL"] == 2  # without the GPU's size
    assert pc.config(16, 3712, 2688, {"CL": 5, "WG": 2}, sms=132) == {"BN": 16, "CL": 5, "WG": 2, "WN": 1,
                                                                       "STAGES": 3, "PF": 2, "DB": 1, "PDL": 1}
    assert pc.config(16, 3712, 2688, {"WG": 1, "WN": 4}, sms=132)["CL"] == 8  # 15 blocks of 256 rows


def test_config_checks():
    for bad in ({"CL": 0}, {"CL": 9}, {"WG": 3}, {"STAGES": 1}, {"PF": 4}, {"WN": 5}, {"WG": 2, "WN": 3}):
        with pytest.raises(ValueError, match="CL must be 1 to 8"):
            pc.config(16, 64, 128, bad)
    with pytest.raises(ValueError, match="unknown launch keys"):
        pc.config(16, 64, 128, {"BLOCK_M": 16})
    # the overlapped loop takes PF 2 (its two slots of codes) and a spare activation buffer
    for bad in ({"DB": 2}, {"DB": 1, "PF": 3}, {"DB": 1, "STAGES": 2}):
        with pytest.raises(ValueError, match="DB must be 0 or 1"):
            pc.config(16, 64, 128, bad)
    # DB 1 by default where it can run
    assert [pc.config(16, 64, 128, cfg)["DB"] for cfg in ({}, {"PF": 3}, {"STAGES": 2}, {"DB": 0})] == [1, 0, 0, 0]
    for m in (0, 65):
        with pytest.raises(ValueError, match="1 to 64 activation rows"):
            pc.config(m, 64, 128)
    # shared memory: STAGES activation tiles per share of K and 1 KiB to align them, within 227 KiB,
    # or each warpgroup's padded sums [BN, 68] where those take more
    assert pc.smem_bytes(64, 3, 4) == 4 * 3 * 64 * 128 * 2 + 1024 <= pc.SMEM_BYTES
    assert pc.smem_bytes(64, 3, 2, 2) == 2 * 3 * 64 * 128 * 2 + 1024
    assert pc.smem_bytes(64, 3, 1, 4) == 4 * 64 * 68 * 4 + 1024 > 3 * 64 * 128 * 2 + 1024
    with pytest.raises(ValueError, match="bytes of shared memory"):
        pc.config(64, 64, 128, {"STAGES": 4, "WG": 4})
    # BN: the wgmma's N, a multiple of 8 up to 64; fewer rows than M take more blocks of rows
    for bn in (0, 12, 72):
        with pytest.raises(ValueError, match="BN .* multiple of 8"):
            pc.config(36, 64, 128, {"BN": bn})
    assert pc.config(36, 3712, 2688, {"BN": 40}, sms=132)["BN"] == 40
    assert pc.launch_grid(64, 3712, pc.config(64, 3712, 2688, {"BN": 32, "CL": 1}, sms=132)) == (58, 2)
    assert pc.smem_bytes(40, 3, 4) == 4 * 3 * 40 * 128 * 2 + 1024
    with pytest.raises(ValueError, match="PDL must be 0 or 1"):
        pc.config(16, 64, 128, {"PDL": 2})


def test_the_source_decodes_with_packed_gemm_and_runs_the_launch_shape():
    src = pc.cuda_source(48, 2, 4, 3, 2)
    # the decoding is packed_gemm's, operand for operand
    want = pg.decode_asm("bf16").replace("$", "%").splitlines()
    lines = [m.group(1)[:-2] for m in re.finditer(r'^\s+"(.*)"$', src, re.M)]
    assert lines[:len(want)] == want
    assert "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16" in src
    assert "wgmma.mma_async.sync.aligned.m64n40k16.f32.bf16.bf16" in pc.cuda_source(40, 2, 4, 3, 2)
    assert "__cluster_dims__(CL, 1, 1)" in src and "#define CL 2" in src and "#define WG 4" in src
    assert "__launch_bounds__(128 * WG * WN, 1)" in src and "#define WN 1" in src and "#define STAGES 3" in src and "#define PF 2" in src
    # 24 accumulators, then the four A registers and the descriptor
    assert '"+f"(d[23])' in src and '"+f"(d[24])' not in src and "%24, %25, %26, %27}, %28" in src
    assert "#define SWIZZLE 1" in src and "#define SWIZZLE 0" in pc.cuda_source(48, 2, 4, 3, 2, swizzle=False)
    assert "#define SKIP_X 0" in src and "#define SKIP_MMA 1" in pc.cuda_source(48, 2, 4, 3, 2, skip=("mma",))
    # DB 1: two sets of A fragments, activations one tile less ahead, one wgmma group left running
    db = pc.cuda_source(48, 2, 4, 3, 2, db=1)
    assert "#define DB 1" in db and "#define AHEAD (STAGES - 1 - DB)" in db and "u32 fa[2][8][4];" in db
    assert '"wgmma.wait_group.sync.aligned %0;\\n" :: "n"(DB)' in db and "#define DB 0" in src and "fa[" not in src
    with pytest.raises(ValueError, match="unknown stages to skip"):
        pc.cuda_source(48, 2, 4, 3, 2, skip=("epilogue",))


def test_a_dependent_launch_reads_only_the_weight_before_its_wait():
    src = pc.cuda_source(48, 2, 4, 3, 2, db=1, pdl=1)
    assert "#define PDL 1" in src and "#define PDL 0" in pc.cuda_source(48, 2, 4, 3, 2, db=1)
    # with PDL the block's first codes and scales are loaded, then it waits for the kernel before
    # (which may write x), then the activation copies start
    body = src[src.index("#if PDL  // the weight"):]
    pre = body[:body.index("#endif")]
    assert pre.index("rw[s][0] = wp[") < pre.index("griddepcontrol.wait;") and "load_x" not in pre
    assert body.index("griddepcontrol.wait;") < body.index("load_x(base + s * STAGE_BYTES")
    # dependents may start once the K loop is done, before the sums are added up and stored
    assert body.index("cp.async.wait_group 0;") < body.index("griddepcontrol.launch_dependents;") < body.index("barrier.cluster")


def test_the_launch_structs_have_cuda_h_layout():
    import ctypes

    # CUlaunchAttribute: a 4-byte id, 4 bytes of padding, a 64-byte value; CUlaunchConfig: seven
    # unsigned ints, the stream at 32, the attributes at 40, their count at 48
    assert ctypes.sizeof(pc._LaunchAttribute) == 72 and pc._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(pc._LaunchConfig) == 56
    assert (pc._LaunchConfig.smem.offset, pc._LaunchConfig.stream.offset, pc._LaunchConfig.attrs.offset,
            pc._LaunchConfig.num_attrs.offset) == (24, 32, 40, 48)


def test_a_launchs_parameters_point_at_the_values_filled_in():
    import ctypes

    # cuLaunchKernel reads parameter i at params[i]: five 8-byte addresses, then five 4-byte ints,
    # refilled in place on each call
    v = pc._ArgValues(5, 5)
    for ptrs, ints in (((0x7F0000001000, 2**64 - 1, 1, 0, 0x10), (32, 3712, 232, 21, 2688)),
                       ((5, 6, 7, 8, 9), (-1, 0, 2**31 - 1, 7, 1))):
        v.fill(ptrs, ints)
        assert [ctypes.c_uint64.from_address(v.params[i]).value for i in range(5)] == list(ptrs)
        assert [ctypes.c_int32.from_address(v.params[5 + i]).value for i in range(5)] == list(ints)
    values, params, cfg = pc._launch_buffers(5, 5, 512, 90000, True)
    assert params is values.params
    assert (cfg.attrs.contents.id, cfg.attrs.contents.value, cfg.num_attrs) == (6, 1, 1)  # programmatic serialization
    assert (list(cfg.block), cfg.grid[2], cfg.smem) == ([512, 1, 1], 1, 90000)
    assert pc._launch_buffers(5, 5, 512, 90000, False)[2] is None  # cuLaunchKernel, no config


def test_the_swizzled_copy_and_the_descriptors_address_the_same_bytes():
    # The copy puts activation (row r, K column c) at (c // 64) * BN * 128 + (r // 8) * 1024 + (r % 8)
    # * 128 + (((c % 64) // 8) ^ (r % 8)) * 16 + (c % 8) * 2; the wgmma reads chunk t's (K 16 t..)
    # row r, column c from its descriptor's start, + (r // 8) * SBO (1024) + (r % 8) * 128 + the
    # 16-byte granule of (start + c * 2) with bits 4-6 xor-ed with bits 7-9 (the 128-byte swizzle)
    bn = 48
    for r in range(bn):
        for c in range(128):
            copy = (c // 64) * bn * 128 + (r // 8) * 1024 + (r % 8) * 128 + (((c % 64) // 8) ^ (r % 8)) * 16 + (c % 8) * 2
            t, cc = divmod(c, 16)
            start = (t >> 2) * bn * 128 + (t & 3) * 32  # `descriptor`'s start for chunk t
            plain = start + (r // 8) * 1024 + (r % 8) * 128 + cc * 2
            swz = plain ^ (((plain >> 7) & 7) << 4)
            assert swz == copy, (r, c)


def _copies(bn, wn, swizzle=True):
    """Where `load_x`'s copy puts each (row, granule) of a tile, thread by thread of a share of WN
    warpgroups (its comment's rule): {(row, granule): byte offset}."""
    out = {}
    for t in range(128 * wn):
        slot = t >> 7
        for j in range(-(-(bn // 8) // wn)):
            jj = slot + wn * j
            if jj >= bn // 8:
                continue
            if swizzle:
                g, r = t & 15, (t >> 4) & 7
                at = (g >> 3) * bn * 128 + jj * 1024 + r * 128 + ((g & 7) ^ r) * 16
            else:
                g, r = (t >> 3) & 15, t & 7
                at = ((g * (bn // 8) + jj) * 8 + r) * 16
            assert (8 * jj + r, g) not in out
            out[8 * jj + r, g] = at
    return out


@pytest.mark.parametrize("wn", [1, 2, 3, 4])
@pytest.mark.parametrize("bn", [16, 32, 48, 64])
def test_a_shares_warpgroups_copy_every_granule_of_a_tile_once(bn, wn):
    src = pc.cuda_source(bn, 2, 1, 3, 2, wn=wn)
    assert "const int jj = slot + WN * j;" in src and f"#define WN {wn}" in src
    for swizzle in (True, False):
        got = _copies(bn, wn, swizzle)
        assert set(got) == {(r, g) for r in range(bn) for g in range(16)}
        assert sorted(got.values()) == list(range(0, bn * 256, 16))  # the stage's bytes, each once
        if swizzle:  # the swizzle test's address of the granule's first value
            assert all(at == (8 * g // 64) * bn * 128 + (r // 8) * 1024 + (r % 8) * 128 + (((8 * g % 64) // 8) ^ (r % 8)) * 16
                       for (r, g), at in got.items())
        else:  # plain 8 x 8 core matrices: granule g's core matrices BN * 16 bytes apart
            assert all(at == ((g * (bn // 8) + r // 8) * 8 + r % 8) * 16 for (r, g), at in got.items())


def test_the_launcher_refuses_the_cpu_and_other_inputs():
    w = pg.pack(quantize(torch.randn(64, 128, dtype=torch.bfloat16) * 0.02, backend="torch"))
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="runs on an sm_90 GPU"):
        pc.packed_matmul_cluster(x, w)


def test_cluster_rows_take_the_entrys_rows_where_a_wave_fills_the_gpu():
    # on 132 multiprocessors: Nano's 3712 x 2688 at clusters of 2 fills 116 with its one wave,
    # 2688 x 3712 fills 84 (>= 0.6 * 132 = 79.2); on 144 multiprocessors 84 falls short (86.4)
    t = pg.launch.table("packed")
    assert t["CLUSTER"] == {"min_rows": 16, "max_rows": 64, "min_fill": 0.6}
    assert [pl.cluster_rows(m, 3712, 2688, 132, t) for m in (1, 15, 16, 20, 32, 48, 49, 64)] == [
        False, False, True, True, True, True, True, True]
    assert all(pl.cluster_rows(m, 2688, 3712, 132, t) for m in (16, 32, 48, 64))
    assert not any(pl.cluster_rows(m, 2688, 3712, 144, t) for m in (16, 32, 48, 64))
    assert all(pl.cluster_rows(m, 2688, 3712, 140, t) for m in (16, 32, 48, 64))  # 84 >= 84.0
    assert not pl.cluster_rows(32, 131072, 2688, 132, t)  # a large weight
    bare = pg.launch.thaw(t)
    del bare["CLUSTER"]
    assert not any(pl.cluster_rows(m, 3712, 2688, 132, bare) for m in (16, 32, 48))  # no entry: never
    assert not pl.uses_cluster(32, 3712, 2688, torch.device("cpu"))


def test_packed_linear_hands_bf16_rows_uses_cluster_names_to_packed_cluster(monkeypatch):
    # the wiring, with the GPU's answer stood in: every row counted, the weight's shape and the
    # input's device asked about, bf16 only (an fp16 weight goes on to packed_ws's rule)
    w = pg.pack(quantize(torch.randn(64, 256, dtype=torch.bfloat16) * 0.02, backend="torch"))
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    asked, handed = [], []
    monkeypatch.setattr(pl, "_default_cluster", lambda *a: asked.append(a) or True)
    monkeypatch.setattr(pc, "packed_matmul_cluster", lambda x_, w_: handed.append((x_, w_)) or "cluster")
    assert pl.packed_linear(x, w) == "cluster" and handed[0][0] is x and handed[0][1] is w
    assert asked == [(6, 64, 256, x.device)]
    assert pl.packed_linear(x, w, backend="torch").shape == (2, 3, 64)
    w16 = pg.pack(quantize(torch.randn(64, 256, dtype=torch.bfloat16) * 0.02, backend="torch"), torch.float16)
    monkeypatch.setattr(pl, "_default_ws", lambda *a: False)
    assert pl.packed_linear(x.half(), w16).shape == (2, 3, 64) and len(handed) == 1
