"""Counts the instructions of a Triton kernel's innermost loop on sm_90, without a GPU.

    python scripts/sass_loop.py fp8-gemv|fp8-gemv-pdl|mamba-step-pdl|moe-gemv|moe-up-pdl|packed|packed-overlap|packed-ws|route-tail|attention-combine [--out ...]

Triton compiles the kernel ahead of time for sm_90 (its bundled ptxas), cuobjdump (bundled too)
disassembles it, and the loop is the last innermost one (a backward branch's range that holds no
other). Per launch shape the JSON rows give the registers, the loop's instructions by opcode and
per weight a thread decodes in one step. This says what the compiler made of a tile (layout
conversions through shared memory, byte permutes, spills), not how fast it runs: the timings come
from the sweeps on a GPU (scripts/tune_kernels.py). Triton here is the installed one, which may
not be the one a GPU machine runs (the JSON's versions say which).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/")
_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
_BRA = re.compile(r"\bBRA\s+(?:`\(\.L_x_\d+\)|(0x[0-9a-f]+))")


def _innermost_loops(sass: str) -> list[list[str]]:
    """The opcodes, in listing order, of each innermost loop of a cuobjdump listing (of the
    backward branches, those whose range, from the branch's target to the branch, holds no other
    backward branch), in listing order."""
    lines = [ln for ln in sass.splitlines() if _OP.search(ln)]
    addr = [int(_ADDR.search(ln).group(1), 16) for ln in lines]
    loops = []
    for ln, here in zip(lines, addr):
        m = _BRA.search(ln)
        if m and m.group(1) and int(m.group(1), 16) < here:
            loops.append((int(m.group(1), 16), here))
    inner = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    return [[_OP.search(ln).group(1) for ln, here in zip(lines, addr) if a <= here <= b] for a, b in inner]


def loop_sequence(sass: str, containing: str | None = None) -> list[str]:
    """The opcodes, in listing order, of the innermost loop in a cuobjdump listing: of the
    innermost loops (`_innermost_loops`), the last one (with `containing`, the last one that
    holds that opcode: not a wait's spin loop); [] where there is none."""
    seqs = [seq for seq in _innermost_loops(sass) if containing is None or containing in seq]
    return seqs[-1] if seqs else []


def _counts(opcodes: list[str]) -> dict:
    ops: dict = {}
    for op in opcodes:
        ops[op] = ops.get(op, 0) + 1
    return dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])))


def loop_ops(sass: str, containing: str | None = None) -> dict:
    """Opcode counts of `loop_sequence`'s loop; {} where there is none."""
    return _counts(loop_sequence(sass, containing))


def ops_after(sass: str, opcode: str) -> dict:
    """Opcode counts of a listing from its first `opcode` on ({} where it has none)."""
    seq = [_OP.search(ln).group(1) for ln in sass.splitlines() if _OP.search(ln)]
    return _counts(seq[seq.index(opcode):]) if opcode in seq else {}


def _grid_dependency(sass: str) -> tuple[list[str], int | None, int | None]:
    """(a listing's opcodes in order, the index of its grid-dependency wait (ACQBULK, PTX
    griddepcontrol.wait) and of its trigger (PREEXIT, griddepcontrol.launch_dependents); None
    where it has none)."""
    seq = [_OP.search(ln).group(1) for ln in sass.splitlines() if _OP.search(ln)]
    return seq, *(seq.index(op) if op in seq else None for op in ("ACQBULK", "PREEXIT"))


def compile_sm90(fn, signature: dict, constants: dict, num_warps: int, divisible: tuple,
                 maxnreg: int | None = None) -> tuple[int, str, int]:
    """(registers, SASS listing, stack bytes per thread) of `fn` compiled for sm_90 with these
    constexprs; `divisible` names the arguments Triton would see as multiples of 16 at launch;
    maxnreg: a register cap per thread (Triton's launch option), None for the compiler's choice."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fp4kit.kernels.backend import interpreted, launch_options

    if interpreted(fn):
        raise RuntimeError("sass_loop compiles kernels for sm_90: run it without TRITON_INTERPRET=1")
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name in divisible}
    options = {"num_warps": num_warps, **launch_options(), **({"maxnreg": maxnreg} if maxnreg else {})}
    source = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():  # a Gluon kernel (its layouts are its own)
        from triton.experimental.gluon._runtime import GluonASTSource as source
    kernel = triton.compile(source(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                            options=options)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([str(tools / "cuobjdump"), "--dump-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1)), sass, int(re.search(r"STACK:(\d+)", usage).group(1))


def _rows(fn, signature, divisible, launches) -> list:
    """One row per (tag, constexprs, warps, weights decoded per thread and loop step) in `launches`;
    a tag's "maxnreg" is compiled as the register cap. "stack": bytes of local memory per thread
    (spilled registers); the loop's LDL / STL among its ops are spills it reloads / stores."""
    out = []
    for tag, consts, nw, weights in launches:
        regs, sass, stack = compile_sm90(fn, signature, consts, nw, divisible, tag.get("maxnreg"))
        ops = loop_ops(sass)
        out.append({**tag, "registers": regs, "stack": stack, "loop_instructions": sum(ops.values()),
                    "per_weight": round(sum(ops.values()) / weights, 3), "ops": ops})
    return out


# `_fp8_gemv_kernel`'s signature, and the arguments a launch on the Mamba projections sees as
# multiples of 16
_FP8_GEMV_SIG = {"x_ptr": "*u8", "w_ptr": "*u8", "xs_ptr": "*fp32", "ws_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32",
                 "N": "i32", "K": "i32", "stride_xm": "i32", "stride_om": "i32", "BLOCK_M": "constexpr",
                 "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "EVEN_K": "constexpr", "NATIVE": "constexpr",
                 "PDL": "constexpr"}
_FP8_GEMV_DIVISIBLE = ("x_ptr", "w_ptr", "xs_ptr", "ws_ptr", "out_ptr", "N", "K", "stride_xm", "stride_om")

# (BLOCK_N, BLOCK_K, warps): BLOCK_K = 512 x warps gives each lane 16 columns of every weight row,
# the activations' own layout; the others put the activation tile through shared memory
FP8_GEMV_TILES = ((1, 512, 1), (2, 512, 1), (4, 512, 1), (2, 1024, 2), (4, 1024, 2), (4, 2048, 4), (8, 512, 4),
                  (16, 512, 4), (8, 256, 2), (4, 512, 4))


# `moe_gemm._moe_small_kernel`'s and `router._route_kernel`'s signatures, and the arguments a
# launch on Nemotron-3-Nano sees as multiples of 16
_MOE_SMALL_SIG = {"x_ptr": "*bf16", "x4_ptr": "*i64", "ids_ptr": "*i64", "wq_ptr": "*i64", "ws_ptr": "*u8",
                  "gs_ptr": "*fp32", "part_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*bf16", "cnt_ptr": "*i32",
                  "A": "i32", "E": "i32", "N": "i32", "K": "i32", "TOPK": "i32", "k_per_split": "i32",
                  "part_stride": "i32",
                  **{name: "constexpr" for name in ("A_PAD", "BY_ASSIGNMENT", "UP", "X_PARTS", "RELU2_OUT", "ACT",
                                                    "BLOCK_M", "BLOCK_N", "BLOCK_K", "IEEE", "LUT", "EVEN_N", "EVEN_K",
                                                    "GEMV", "KB", "AHEAD", "COMBINE", "TOPK_C", "TRIGGER", "WAIT",
                                                    "WAIT_FIRST")}}
_MOE_SMALL_DIVISIBLE = ("x_ptr", "x4_ptr", "ids_ptr", "wq_ptr", "ws_ptr", "gs_ptr", "part_ptr", "E", "N", "K",
                        "k_per_split", "part_stride")
_ROUTE_SIG = {"x_ptr": "*bf16", "w_ptr": "*fp32", "b_ptr": "*fp32", "logits_ptr": "*fp32", "ids_ptr": "*i64",
              "wout_ptr": "*fp32", "cnt_ptr": "*i32", "E": "i32", "K": "i32", "stride_x": "i32", "stride_w": "i32",
              "scale": "fp32",
              **{name: "constexpr" for name in ("TOPK", "NORM", "BLOCK_R", "BLOCK_K", "BLOCK_E", "TOPK_P2", "PDL",
                                                "NATIVE", "TRIGGER")}}
_ROUTE_DIVISIBLE = ("x_ptr", "w_ptr", "b_ptr", "logits_ptr", "ids_ptr", "wout_ptr", "cnt_ptr", "E", "K", "stride_x",
                    "stride_w")


def fp8_gemv(rows=(1, 2, 4), tiles=FP8_GEMV_TILES, pdl=False) -> list:
    """`_fp8_gemv_kernel`'s K loop per (activation rows per program, BLOCK_N, BLOCK_K, warps), as a
    launch on the Mamba projections specialises it (K, N and the strides multiples of 16; one row:
    M = 1, a constant); pdl: as a programmatic dependent launch (rows tagged "pdl")."""
    from fp4kit.kernels import fp8_gemm as fg

    sig, divisible = dict(_FP8_GEMV_SIG), _FP8_GEMV_DIVISIBLE
    out = []
    for bm in rows:  # one row: M = 1, which Triton makes a constant
        s, fixed = (dict(sig, M="constexpr"), {"M": 1}) if bm == 1 else (sig, {})
        out += _rows(fg._fp8_gemv_kernel, s, divisible,
                     [({"rows": bm, "tile": [bn, bk, nw], **({"pdl": True} if pdl else {})},
                       dict(fixed, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=True, NATIVE=True, PDL=pdl), nw,
                       bn * bk / (32 * nw))
                      for bn, bk, nw in tiles])
    return out


def fp8_gemv_pdl(tiles=((4, 1024, 2), (1, 1024, 2), (1, 512, 1)), even_k=(False, True)) -> list:
    """`_fp8_gemv_kernel` at one activation row as a programmatic dependent launch (PDL), K masked
    (the in_proj shape, K = 2688) or not: where its wait for the launch before it (ACQBULK, PTX
    griddepcontrol.wait) and its trigger for the launch after it (PREEXIT,
    griddepcontrol.launch_dependents) fall among its loads and stores, against the 16-byte weight
    loads of one K tile per thread ("tile_loads": BLOCK_N x BLOCK_K / (16 x threads)). Before the
    wait only the first tile's weight loads may be issued (the activations are the launch
    before's output); before the trigger no store. "loop_same": the K loop's instructions are the
    plain launch's."""
    from fp4kit.kernels import fp8_gemm as fg

    sig, divisible = dict(_FP8_GEMV_SIG, M="constexpr"), _FP8_GEMV_DIVISIBLE
    rows = []
    for even in even_k:
        for bn, bk, nw in tiles:
            listings = {}
            for pdl in (False, True):
                consts = dict(M=1, BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=even, NATIVE=True, PDL=pdl)
                listings[pdl] = compile_sm90(fg._fp8_gemv_kernel, sig, consts, nw, divisible)
            regs, sass, stack = listings[True]
            seq, wait, trigger = _grid_dependency(sass)
            loop = loop_ops(sass)
            rows.append({"tile": [bn, bk, nw], "even_k": even, "pdl": True, "registers": regs, "stack": stack,
                         "plain_registers": listings[False][0], "tile_loads": bn * bk // (16 * 32 * nw),
                         "loads_before_wait": None if wait is None else seq[:wait].count("LDG"),
                         "stores_before_trigger": None if trigger is None else seq[:trigger].count("STG"),
                         "wait_before_trigger": wait is not None and trigger is not None and wait < trigger,
                         "loop_same": loop == loop_ops(listings[False][1]), "loop_instructions": sum(loop.values()),
                         "ops": loop})
    return rows


def mamba_step_pdl() -> list:
    """`mamba._mamba_step_kernel` as a Nemotron-3-Nano mixer launches it at decode (64 heads of 64,
    8 groups, N = 128, 4 taps, bf16, FP8 output), plainly and as a programmatic dependent launch:
    the global loads before its wait for the launch before it (ACQBULK), against the state rows'
    16-byte loads per thread ("state_loads": BLOCK_P x N fp32 over 128 threads) and the head's
    three parameters; stores before the wait (must be 0: it writes nothing that launch may still
    read or write); whether the trigger for the launch after it (PREEXIT) follows the wait."""
    from fp4kit.kernels import mamba

    sig = {"proj_ptr": "*bf16", "conv_ptr": "*bf16", "ssm_ptr": "*fp32", "cw_ptr": "*bf16", "cb_ptr": "*bf16",
           "dtb_ptr": "*fp32", "alog_ptr": "*fp32", "d_ptr": "*fp32", "nw_ptr": "*bf16", "scale_ptr": "*fp32",
           "gated_ptr": "*fp32", "out_ptr": "*u8", "cnt_ptr": "*i32", "stride_proj": "i32", "eps": "fp32",
           "inv_group": "fp32"}
    sig.update({name: "constexpr" for name in ("H", "P", "N", "G", "S", "K", "HALF", "BIAS", "D_WIDE", "OUT_FP8",
                                               "LIBDEVICE", "BLOCK_P", "BLOCK_N", "BLOCK_GS", "S_PAD", "PDL")})
    rows = []
    for pdl in (False, True):
        consts = dict(H=64, P=64, N=128, G=8, S=4, K=4, HALF=1, BIAS=True, D_WIDE=True, OUT_FP8=True, LIBDEVICE=True,
                      BLOCK_P=mamba.BLOCK_P, BLOCK_N=128, BLOCK_GS=512, S_PAD=4, PDL=pdl)
        regs, sass, stack = compile_sm90(mamba._mamba_step_kernel, sig, consts, 4,
                                         ("proj_ptr", "conv_ptr", "ssm_ptr", "stride_proj"))
        seq, wait, trigger = _grid_dependency(sass)
        rows.append({"pdl": pdl, "registers": regs, "stack": stack, "instructions": len(seq),
                     "state_loads": mamba.BLOCK_P * 128 * 4 // (16 * 128),
                     "loads_before_wait": None if wait is None else seq[:wait].count("LDG"),
                     "stores_before_wait": None if wait is None else seq[:wait].count("STG"),
                     "wait_before_trigger": wait is not None and trigger is not None and wait < trigger,
                     "ops": _counts(seq)})
    return rows


def moe_gemv(tiles=((4, 512, 1, None), (8, 512, 1, None), (8, 512, 1, 96), (4, 1024, 2, None), (4, 512, 1, None, 2),
                   (4, 512, 1, None, 3), (8, 512, 1, None, 2))) -> list:
    """`_moe_small_kernel`'s K loop on the CUDA cores (`tiles.gemv_accumulate`) as one token's up
    projection launches it on Nemotron-3-Nano (K = 2688, not a multiple of BLOCK_K: masked loads),
    per (BLOCK_N, BLOCK_K, warps, register cap[, K tiles in flight: AHEAD, 1 if not given]); one
    activation row."""
    import triton.language as tl

    from fp4kit.kernels import moe_gemm as mg

    sig, divisible = _MOE_SMALL_SIG, _MOE_SMALL_DIVISIBLE
    launches = [({"tile": [bn, bk, nw], **({"maxnreg": cap} if cap else {}), **({"ahead": a[0]} if a else {})},
                 dict(A_PAD=8, BY_ASSIGNMENT=True, UP=True, X_PARTS=0, RELU2_OUT=True, ACT=tl.bfloat16, BLOCK_M=1,
                      BLOCK_N=bn, BLOCK_K=bk, IEEE=False, LUT=True, EVEN_N=True, EVEN_K=False, GEMV=True, KB=2688 // 16,
                      AHEAD=a[0] if a else 1, COMBINE=False, TOPK_C=1, TRIGGER=False, WAIT=False, WAIT_FIRST=False),
                 nw, bn * bk / (32 * nw)) for bn, bk, nw, cap, *a in tiles]
    return _rows(mg._moe_small_kernel, sig, divisible, launches)


def moe_up_pdl() -> list:
    """The MoE up launch (`_moe_small_kernel`, one token on Nano, the one-warp 8 x 512 tile) plainly,
    triggering the down launch (TRIGGER), and as a programmatic dependent of the router that waits
    first (WAIT_FIRST with TRIGGER); and the router (`router._route_kernel`, 4 experts per program,
    4 warps) with and without its trigger. Per listing: the global loads, stores and atomics
    before its wait (ACQBULK) and before its trigger (PREEXIT), and whether the wait comes first."""
    import triton.language as tl

    from fp4kit.kernels import moe_gemm as mg
    from fp4kit.kernels import router as rt


    def where(kernel, name, sass):
        seq, wait, trigger = _grid_dependency(sass)

        def before(i, ops):
            return None if i is None else sum(seq[:i].count(op) for op in ops)

        return {"kernel": kernel, **name, "instructions": len(seq),
                "loads_before_wait": before(wait, ("LDG",)), "writes_before_wait": before(wait, ("STG", "ATOMG", "RED")),
                "loads_before_trigger": before(trigger, ("LDG",)),
                "writes_before_trigger": before(trigger, ("STG", "ATOMG", "RED")),
                "wait_before_trigger": wait is not None and trigger is not None and wait < trigger}

    rows = []
    for trigger, first in ((False, False), (True, False), (True, True)):
        consts = dict(A_PAD=8, BY_ASSIGNMENT=True, UP=True, X_PARTS=0, RELU2_OUT=True, ACT=tl.bfloat16, BLOCK_M=1,
                      BLOCK_N=8, BLOCK_K=512, IEEE=False, LUT=True, EVEN_N=True, EVEN_K=False, GEMV=True,
                      KB=2688 // 16, AHEAD=1, COMBINE=False, TOPK_C=1, TRIGGER=trigger, WAIT=False, WAIT_FIRST=first)
        _, sass, _ = compile_sm90(mg._moe_small_kernel, _MOE_SMALL_SIG, consts, 1, _MOE_SMALL_DIVISIBLE)
        rows.append(where("moe-up", {"trigger": trigger, "wait_first": first}, sass))
    for trigger in (False, True):
        consts = dict(TOPK=6, NORM=True, BLOCK_R=4, BLOCK_K=4096, BLOCK_E=128, TOPK_P2=8, PDL=False, NATIVE=True,
                      TRIGGER=trigger)
        _, sass, _ = compile_sm90(rt._route_kernel, _ROUTE_SIG, consts, 4, _ROUTE_DIVISIBLE)
        rows.append(where("route", {"trigger": trigger}, sass))
    return rows


def packed(launches=((16, 1), (32, 1), (64, 1), (32, 2), (64, 2))) -> list:
    """`packed_gemm._packed_kernel`'s K loop per (BLOCK_M, UNROLL), one warpgroup (64 weight rows),
    split-K, bf16: per K tile of 128 a thread decodes 64 weights and the warpgroup issues eight
    wgmma of K 16."""
    from fp4kit.kernels import packed_gemm as pg

    sig = {"x_ptr": "*bf16", "x_desc": "*bf16", "w_ptr": "*i16", "s_ptr": "*bf16", "gs_ptr": "*fp32",
           "out_ptr": "*bf16", "part_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
           "N16": "i32", "KT": "i32", "stride_xm": "i32", "kt_per_split": "i32"}
    sig.update({name: "constexpr" for name in ("BLOCK_M", "W", "SPLIT", "UNROLL", "PREFETCH", "F16", "EVEN_K",
                                               "EMULATE", "TMA")})
    divisible = ("x_ptr", "w_ptr", "s_ptr", "gs_ptr", "out_ptr", "part_ptr", "cnt_ptr", "N", "K", "stride_xm")
    rows = [({"BLOCK_M": bm, "UNROLL": u}, dict(BLOCK_M=bm, W=4, SPLIT=3, UNROLL=u, PREFETCH=0, F16=False, EVEN_K=True,
                                                EMULATE=False, TMA=False), 4, 64 * u) for bm, u in launches]
    return _rows(pg._packed_kernel, sig, divisible, rows)


def packed_overlap(launches=((16, 3, 2, 0), (32, 3, 2, 0), (64, 2, 2, 0), (64, 3, 2, 0), (64, 3, 3, 0), (64, 3, 3, 4))) -> list:
    """`packed_overlap._overlap_kernel`'s K loop (Gluon) per (BLOCK_M, STAGES, AHEAD, PREFETCH), split-K, bf16: per
    K tile a thread decodes the next tile's 64 weights while the warpgroup's eight wgmma of this
    one run. "wgmma_waits": the loop's waits for its wgmma by the number left in flight (a
    pipelined loop waits with one in flight; a serialized one with none)."""
    from triton.experimental.gluon import language as gl

    from fp4kit.kernels import packed_overlap as po

    rows = []
    for bm, stages, ahead, prefetch in launches:
        layout = gl.NVMMASharedLayout.get_default_for([bm, 128], gl.bfloat16)
        sig = {"x_desc": f"tensordesc<bf16[{bm}, 128],{layout!r}>", "w_ptr": "*i16", "s_ptr": "*bf16",
               "gs_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32",
               "N16": "i32", "KT": "i32", "kt_per_split": "i32", "BLOCK_M": "constexpr", "SPLIT": "constexpr",
               "STAGES": "constexpr", "F16": "constexpr", "AHEAD": "constexpr", "PREFETCH": "constexpr"}
        divisible = ("w_ptr", "s_ptr", "gs_ptr", "out_ptr", "part_ptr", "cnt_ptr")
        regs, sass, stack = compile_sm90(po._overlap_kernel, sig, dict(BLOCK_M=bm, SPLIT=3, STAGES=stages, F16=False,
                                                                       AHEAD=ahead, PREFETCH=prefetch), 4, divisible)
        ops = loop_ops(sass, containing="HGMMA")
        waits: dict = {}
        for left in re.findall(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*(0x[0-9a-f]+)", sass):
            waits[int(left, 16)] = waits.get(int(left, 16), 0) + 1
        rows.append({"BLOCK_M": bm, "STAGES": stages, "AHEAD": ahead, "PREFETCH": prefetch, "registers": regs, "stack": stack,
                     "loop_instructions": sum(ops.values()), "per_weight": round(sum(ops.values()) / 64, 3),
                     "ops": ops, "wgmma_waits": {str(k): v for k, v in sorted(waits.items())}})
    return rows


def packed_ws(launches=((32, 4, 2), (32, 2, 4), (16, 4, 2), (64, 4, 2), (64, 2, 2))) -> list:
    """`packed_ws._ws_kernel` (Gluon, warp-specialized) per (BLOCK_M, P, XS), unsplit, bf16, with
    the launcher's register budget: registers and stack per thread, the whole listing's wgmma
    (eight per K tile in each of the P warpgroups' loops, each loop running XS tiles, one per
    activation buffer), the waits for them (one per K tile), the named barriers of 128 threads it
    uses (each partition synchronises its own warps on its own barrier) and the partitions' loops:
    how many wgmma each issues before its last decoding multiply (HMUL2), i.e. with decoding still
    to do, and per K tile its instructions, funnel shifts (SHF), multiplies (HMUL2), byte permutes
    (PRMT) and the uniform shifts and sign extensions (USHF, USGXT) that build a wgmma operand
    descriptor at run time. Also the listing's instructions and the partitions' K loops' together
    (each partition has its own copy of its loop, and each of the SM's four schedulers runs a warp
    of every partition: the loop code one scheduler runs, at 16 bytes an instruction)."""
    from triton.experimental.gluon import language as gl

    from fp4kit.kernels import packed_ws as ws

    rows = []
    for bm, p, xs in launches:
        layout = gl.NVMMASharedLayout.get_default_for([bm, 128], gl.bfloat16)
        sig = {"x_desc": f"tensordesc<bf16[{bm}, 128],{layout!r}>", "w_ptr": "*i16", "s_ptr": "*bf16",
               "gs_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32",
               "N16": "i32", "KT": "i32", "kt_per_split": "i32", "BLOCK_M": "constexpr", "SPLIT": "constexpr",
               "P": "constexpr", "XS": "constexpr", "WORKER_REGS": "constexpr"}
        regs_budget = ws.config(bm, 3712, 2688, {"BLOCK_M": bm, "P": p, "XS": xs})["WORKER_REGS"]
        divisible = ("w_ptr", "s_ptr", "gs_ptr", "out_ptr", "part_ptr", "cnt_ptr")
        regs, sass, stack = compile_sm90(ws._ws_kernel, sig, dict(BLOCK_M=bm, SPLIT=1, P=p, XS=xs,
                                                                  WORKER_REGS=regs_budget), 4, divisible,
                                         maxnreg=regs_budget)
        early, per_tile, loop_total = [], [], 0
        for seq in (seq for seq in _innermost_loops(sass) if "HGMMA" in seq):
            loop_total += len(seq)
            last_mul = max(i for i, op in enumerate(seq) if op == "HMUL2")
            early.append(seq[:last_mul].count("HGMMA"))
            per_tile.append({"instructions": len(seq) / xs, "SHF": seq.count("SHF") / xs,
                             "HMUL2": seq.count("HMUL2") / xs, "PRMT": seq.count("PRMT") / xs,
                             "descriptor_ops": (seq.count("USHF") + seq.count("USGXT")) / xs})
        rows.append({"BLOCK_M": bm, "P": p, "XS": xs, "register_budget": regs_budget, "registers": regs,
                     "stack": stack, "hgmma": len(re.findall(r"\bHGMMA\.", sass)),
                     "wgmma_waits": len(re.findall(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x0\b", sass)),
                     "named_barriers": sorted({int(b, 16) for b in re.findall(r"BAR\.SYNC\.DEFER_BLOCKING (0x[0-9a-f]+), 0x80", sass)}),
                     "hgmma_before_last_decode": early, "loop_per_tile": per_tile,
                     "listing_instructions": len([ln for ln in sass.splitlines() if _OP.search(ln)]),
                     "loop_instructions_all_partitions": loop_total})
    return rows


def route_tail(launches=((1, 1, False), (4, 4, False), (4, 4, True))) -> list:
    """`router._route_kernel` as Nemotron-3-Nano's router launches it (128 experts, top 6, K =
    2688, normalised) per (experts per program, warps, pdl): the instructions of the last
    program's tail, from its arrival at the token's counter (ATOMG) on. Its barriers (BAR) and
    shuffles (SHFL) are the steps of its reductions, which run one after another. With pdl, the
    global loads before the program's wait for the launch before it (ACQBULK) and its stores and
    atomics there (must be 0)."""
    from fp4kit.kernels import router as rt

    sig, divisible = _ROUTE_SIG, _ROUTE_DIVISIBLE
    rows = []
    for per, nw, pdl in launches:
        consts = dict(TOPK=6, NORM=True, BLOCK_R=per, BLOCK_K=4096, BLOCK_E=128, TOPK_P2=8, PDL=pdl, NATIVE=True,
                      TRIGGER=False)
        regs, sass, stack = compile_sm90(rt._route_kernel, sig, consts, nw, divisible)
        ops = ops_after(sass, "ATOMG")
        row = {"experts": per, "warps": nw, "pdl": pdl, "registers": regs, "stack": stack,
               "tail_instructions": sum(ops.values()), "ops": ops}
        if pdl:
            seq, wait, _ = _grid_dependency(sass)
            row["loads_before_wait"] = None if wait is None else seq[:wait].count("LDG")
            row["stores_before_wait"] = None if wait is None else seq[:wait].count("STG") + seq[:wait].count("ATOMG")
        rows.append(row)
    return rows


def attention_combine() -> list:
    """`attention._decode_attention_kernel` as a Nemotron-3-Nano attention layer launches it at
    decode (16 query heads per key/value head, head size 128, a bool mask): the last program's
    loop that sums the splits' partials (the listing's last loop), and how many global loads it
    issues before its first exponential (MUFU): the partials in flight together."""
    from fp4kit.kernels import attention as at

    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "m_ptr": "*i1", "o_ptr": "*bf16", "part_ptr": "*fp32",
           "cnt_ptr": "*i32", "S": "i32", "heads_kv": "i32", "per_split": "i32", "scale": "fp32"}
    sig.update({name: "i32" for name in ("sq_b", "sq_h", "sk_b", "sk_h", "sk_s", "sv_b", "sv_h", "sv_s", "sm_b",
                                         "sm_s")})
    sig.update({name: "constexpr" for name in ("G", "D", "BLOCK_G", "BLOCK_D", "BLOCK_N", "MASK", "IEEE", "SPLITS",
                                               "COMBINE")})
    divisible = ("q_ptr", "k_ptr", "v_ptr", "m_ptr", "o_ptr", "part_ptr", "cnt_ptr", "S", "per_split", "sq_b", "sq_h",
                 "sk_b", "sk_h", "sk_s", "sv_b", "sv_h", "sv_s", "sm_b")
    consts = dict(G=16, D=128, BLOCK_G=16, BLOCK_D=128, BLOCK_N=at.BLOCK_N, MASK=1, IEEE=False, SPLITS=at.SPLITS,
                  COMBINE=at.COMBINE)
    regs, sass, stack = compile_sm90(at._decode_attention_kernel, sig, consts, 4, divisible)
    seq = loop_sequence(sass, containing="MUFU")
    first_exp = seq.index("MUFU") if "MUFU" in seq else len(seq)
    return [{"combine": at.COMBINE, "registers": regs, "stack": stack, "loop_instructions": len(seq),
             "loads_before_exp": seq[:first_exp].count("LDG"), "ops": _counts(seq)}]


KERNELS = {"fp8-gemv": fp8_gemv, "fp8-gemv-pdl": fp8_gemv_pdl, "mamba-step-pdl": mamba_step_pdl, "moe-gemv": moe_gemv, "moe-up-pdl": moe_up_pdl, "packed": packed, "packed-overlap": packed_overlap, "packed-ws": packed_ws,
           "route-tail": route_tail, "attention-combine": attention_combine}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", choices=sorted(KERNELS))
    ap.add_argument("--out", help="write the rows as JSON (date, command, versions) here")
    args = ap.parse_args(argv)
    rows = KERNELS[args.kernel]()
    print(f"{'launch':>36} {'regs':>5} {'stack':>5} {'loop':>5} {'per weight':>10}  shared-memory ops, permutes, shuffles")
    for r in rows:
        counted = ("registers", "stack", "loop_instructions", "tail_instructions", "per_weight", "ops")
        tag = {k: v for k, v in r.items() if k not in counted}
        if "ops" not in r:  # packed-ws: its loops' counts per K tile, in the tag
            print(f"{json.dumps(tag)} {r['registers']:>5} {r['stack']:>5}")
            continue
        smem = {k: v for k, v in r["ops"].items() if k in ("BAR", "STS", "STSM", "LDS", "LDGSTS", "PRMT", "SHFL")}
        size = r.get("loop_instructions", r.get("tail_instructions", ""))
        print(f"{json.dumps(tag):>36} {r['registers']:>5} {r['stack']:>5} {size:>5} {r.get('per_weight', ''):>10}  "
              f"{smem}")
    if args.out:
        from benchlib.record import run_record

        record = run_record(None if argv is None else [str(ROOT / "scripts" / "sass_loop.py"), *argv])
        record["versions"]["target"] = "sm_90 (ahead of time, no GPU)"
        Path(args.out).write_text(json.dumps({**record, "kernel": args.kernel, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
