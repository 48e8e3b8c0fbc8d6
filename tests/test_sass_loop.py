"""scripts/sass_loop.py: the innermost loop found in a SASS listing, and one real sm_90 compile of
the FP8 GEMV (Triton's bundled ptxas and cuobjdump; no GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import sass_loop  # noqa: E402

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E R2, desc[UR4][R2.64] ;
        /*0020*/                   FFMA R3, R2, R2, R3 ;
        /*0030*/              @!P0 BRA 0x10 ;
        /*0040*/                   LDS R4, [R5] ;
        /*0050*/                   FFMA R6, R4, R4, R6 ;
        /*0060*/                   FFMA R6, R4, R4, R6 ;
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0080*/              @!P1 BRA 0x40 ;
        /*0090*/                   STG.E desc[UR4][R8.64], R6 ;
        /*00a0*/              @P2 BRA 0x40 ;
        /*00b0*/                   EXIT ;
        /*00c0*/                   BRA 0xc0;
"""


def test_the_loop_is_the_last_backward_branch():
    # 0x40..0x80: inside the outer loop 0x40..0xa0, after the loop 0x10..0x30 (the branch to itself
    # at 0xc0 is the end padding, not a loop)
    assert sass_loop.loop_ops(LISTING) == {"FFMA": 2, "BAR": 1, "BRA": 1, "LDS": 1}
    assert sass_loop.loop_ops("        /*0000*/  EXIT ;\n") == {}


def _compiled_rows(call: str) -> list:
    """The rows of `sass_loop.<call>` run in a process of its own: this one may run Triton's
    interpreter, which compiles nothing."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", f"import json, sass_loop; print(json.dumps(sass_loop.{call}))"],
                          cwd=SCRIPTS, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode and "FileNotFoundError" in done.stderr:  # a triton without its bundled CUDA tools
        pytest.skip("no sm_90 toolchain")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_fp8_gemv_one_tile_compiles_for_sm90():
    (row,) = _compiled_rows("fp8_gemv(rows=(1,), tiles=((8, 512, 4),))")
    assert row["tile"] == [8, 512, 4] and row["registers"] > 0
    # 32 weights per thread and step: one fma each, plus their decoding
    assert row["ops"]["FFMA"] == 32 and row["per_weight"] == round(row["loop_instructions"] / 32, 3)


def test_the_programmatic_dependent_fp8_gemv_requests_only_weights_before_its_wait():
    # As a programmatic dependent launch: its first K tile's weight loads (4 rows x 16 bytes per
    # thread on the 4 x 1024 two-warp tile), and no activation load, before the wait for the launch
    # before it (ACQBULK); no store before the trigger for the launch after it (PREEXIT); the K loop
    # the plain launch's. A launch that read x first, or triggered after its stores, fails here.
    rows = _compiled_rows("fp8_gemv_pdl(tiles=((4, 1024, 2),))")
    assert [r["even_k"] for r in rows] == [False, True]
    for r in rows:
        assert r["tile_loads"] == 4 and r["loads_before_wait"] == 4
        assert r["stores_before_trigger"] == 0 and r["wait_before_trigger"] and r["loop_same"]


def test_the_programmatic_dependent_mamba_step_reads_only_its_state_and_parameters_before_its_wait():
    # As a programmatic dependent launch the step kernel loads its SSM state rows (4 x 16 bytes per
    # thread) and the head's dt_bias, A_log and D, nothing of proj, before its wait, stores
    # nothing before it, and triggers the launch after it only after it; the plain launch has
    # neither instruction.
    plain, early = _compiled_rows("mamba_step_pdl()")
    assert plain["loads_before_wait"] is None and not plain["wait_before_trigger"]
    assert early["state_loads"] == 4 and early["loads_before_wait"] == early["state_loads"] + 3
    assert early["stores_before_wait"] == 0 and early["wait_before_trigger"]


def test_a_register_cap_is_compiled_in():
    # The MoE GEMV's one-warp 8 x 512 tile, uncapped and under a cap of 96 registers.
    free, capped = _compiled_rows("moe_gemv(tiles=((8, 512, 1, None), (8, 512, 1, 96)))")
    assert "maxnreg" not in free and capped["maxnreg"] == 96
    assert capped["registers"] <= 96 < free["registers"]
    assert free["stack"] >= 0 and capped["ops"]["FFMA"] == free["ops"]["FFMA"] == 128


def test_an_interpreted_kernel_is_refused():
    pytest.importorskip("triton")
    from fp4kit.kernels import fp8_gemm
    from fp4kit.kernels.backend import interpreted

    if not interpreted(fp8_gemm._fp8_gemv_kernel):
        pytest.skip("the kernels are compiled in this process")
    with pytest.raises(RuntimeError, match="without TRITON_INTERPRET=1"):
        sass_loop.compile_sm90(fp8_gemm._fp8_gemv_kernel, {}, {}, 4, ())


def test_the_overlapped_gemm_keeps_a_tiles_wgmma_in_flight_while_it_decodes_the_next():
    # Gluon, compiled for sm_90: the A tile's conversion to the wgmma fragment layout moves no data
    # (the kernel asserts it, so a compile is the check), no spills, the loop issues one tile's
    # eight wgmma and waits with one group left in flight (0 only after the loop); the next tile's
    # decoding sits between the first wgmma and that wait.
    for row in _compiled_rows("packed_overlap(launches=((64, 3, 2, 0), (64, 3, 3, 4)))"):
        assert row["stack"] == 0 and row["ops"]["HGMMA"] == 8
        assert row["wgmma_waits"] == {"0": 1, "1": 1}
        assert row["ops"]["HMUL2"] == 32 and row["ops"]["LOP3"] + row["ops"]["SHF"] >= 64  # 8 words: 4 multiplies each


def test_the_warp_specialized_gemm_compiles_without_spills_one_barrier_per_warpgroup():
    # Gluon, compiled for sm_90 with the launcher's register budget: no spills, eight wgmma per K
    # tile and one wait for them per tile, each warpgroup's loop running XS tiles (one per
    # activation buffer), each of the P partitions on a named barrier of its own (a CTA-wide
    # barrier inside one partition would wait for warps that never reach it), and in each loop
    # wgmma issued while the decoding goes on: at least two before its last decoding multiply
    # (a loop decoded whole and then issued has none). The decoding moves bits with plain shifts:
    # of its 8 words per thread and tile only the right shifts (two per word) are funnel shifts
    # (SHF), the left ones integer multiplies; with rotations (shf.l.wrap) a tile had 40. One
    # paired multiply per fragment register: 32. Each buffer's wgmma operand descriptors are
    # constants of the loop (a buffer index worked out at run time built them per wgmma, with
    # uniform shifts and sign extensions in the loop).
    rows = _compiled_rows("packed_ws()")
    assert [(r["BLOCK_M"], r["P"], r["XS"]) for r in rows] == [(32, 4, 2), (32, 2, 4), (16, 4, 2), (64, 4, 2),
                                                               (64, 2, 2)]
    for row in rows:
        assert row["stack"] == 0 and row["registers"] <= row["register_budget"]
        assert row["hgmma"] == 8 * row["P"] * row["XS"] and row["wgmma_waits"] == row["P"] * row["XS"]
        assert len(row["named_barriers"]) == row["P"]
        assert len(row["hgmma_before_last_decode"]) == row["P"] and min(row["hgmma_before_last_decode"]) >= 2
        for tile in row["loop_per_tile"]:
            assert tile["SHF"] <= 2 * 8 + 1 and tile["HMUL2"] == 32 and tile["descriptor_ops"] == 0
            assert tile["instructions"] <= 230


def test_the_ops_after_an_opcode_and_the_loops_order():
    assert sass_loop.ops_after(LISTING, "LDS") == {"FFMA": 2, "BRA": 3, "BAR": 1, "EXIT": 1, "LDS": 1, "STG": 1}
    assert sass_loop.ops_after(LISTING, "HMMA") == {}
    assert sass_loop.loop_sequence(LISTING) == ["LDS", "FFMA", "FFMA", "BAR", "BRA"]
    assert sass_loop.loop_sequence(LISTING, containing="LDG") == ["LDG", "FFMA", "BRA"]


def test_the_routers_tail_takes_one_reduction_per_pick():
    # Nano's router, 4 warps (the launch table's): the last program's tail from its arrival on.
    # One maximum per pick (value and expert packed together, carrying the score) and the picks'
    # order worked out on the picks alone: at most 5 barriers per pick of the 6; picking by a
    # maximum and then a minimum per pick, with a reduction per output, took 55.
    # As a programmatic dependent: the program's router weight rows (4 x 4096 fp32 over 128
    # threads, 16 bytes a load) are requested before it waits for the launch before it, and
    # nothing is stored or counted before then; its tail is the plain launch's.
    one, four, early = _compiled_rows("route_tail()")
    assert (one["warps"], four["warps"]) == (1, 4) and four["stack"] == 0
    assert four["ops"]["BAR"] <= 5 * 6
    assert one["ops"].get("BAR", 0) <= 3  # one warp: its reductions are shuffles
    assert "loads_before_wait" not in four and (early["experts"], early["warps"], early["pdl"]) == (4, 4, True)
    assert early["loads_before_wait"] >= 4 * 4096 * 4 // (128 * 16) and early["stores_before_wait"] == 0
    assert early["ops"]["BAR"] == four["ops"]["BAR"]


def test_the_attentions_last_program_has_a_steps_partials_in_flight_together():
    # Each split's partials are 2 + (16 x 128 fp32 per 128 threads) loads; COMBINE splits of them
    # are issued before the loop step's first exponential, not one split's per step.
    from fp4kit.kernels import attention

    (row,) = _compiled_rows("attention_combine()")
    assert row["combine"] == attention.COMBINE >= 4 and row["stack"] == 0
    assert row["loads_before_exp"] >= 3 * attention.COMBINE
    assert row["ops"]["MUFU"] >= attention.COMBINE


def test_the_up_launch_waits_for_the_router_before_it_triggers_the_down_launch():
    # The down launch reads the routed ids before its own wait, so an up launch that is itself a
    # programmatic dependent of the router (WAIT_FIRST) must wait for the router before anything,
    # its trigger for the down launch included: no load or store before its wait, the wait before
    # the trigger. The plain up launch has neither instruction; the triggering one, no wait. The
    # router with TRIGGER lets the launch after it start before it loads or writes anything.
    plain, trig, first, route, route_trig = _compiled_rows("moe_up_pdl()")
    assert (plain["loads_before_wait"], plain["loads_before_trigger"]) == (None, None)
    assert trig["loads_before_wait"] is None and trig["loads_before_trigger"] == 0
    assert first["wait_before_trigger"] and first["loads_before_wait"] == 0 and first["writes_before_wait"] == 0
    assert first["instructions"] == trig["instructions"] == plain["instructions"]
    assert route["loads_before_trigger"] is None
    assert route_trig["loads_before_trigger"] == 0 and route_trig["writes_before_trigger"] == 0
    assert route_trig["loads_before_wait"] is None  # the router itself waits only with its own "pdl"
