"""Counts the instructions of a Triton kernel's innermost loop on sm_90, without a GPU.

    python scripts/sass_loop.py fp8-gemv [--out benchmarks/results/fp8-gemv-sass.json]

Triton compiles the kernel ahead of time for sm_90 (its bundled ptxas), cuobjdump (bundled too)
disassembles it, and the loop is the range of the last backward branch. Per launch shape the
JSON rows give the registers, the loop's instructions by opcode and per weight it decodes. This
says what the compiler made of a tile (layout conversions through shared memory, byte permutes,
spills), not how fast it runs: the timings come from the sweeps on a GPU (scripts/tune_kernels.py).
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


def loop_ops(sass: str) -> dict:
    """Opcode counts of the innermost loop in a cuobjdump listing: the instructions from the target
    of the last backward branch to that branch ({} where there is none)."""
    lines = [ln for ln in sass.splitlines() if _OP.search(ln)]
    body: list = []
    for ln in lines:
        here = int(_ADDR.search(ln).group(1), 16)
        m = _BRA.search(ln)
        if m and m.group(1) and int(m.group(1), 16) < here:
            start = int(m.group(1), 16)
            body = [x for x in lines if start <= int(_ADDR.search(x).group(1), 16) <= here]
    ops: dict = {}
    for ln in body:
        op = _OP.search(ln).group(1)
        ops[op] = ops.get(op, 0) + 1
    return dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])))


def compile_sm90(fn, signature: dict, constants: dict, num_warps: int, divisible: tuple) -> tuple[int, str]:
    """(registers, SASS listing) of `fn` compiled for sm_90 with these constexprs; `divisible`
    names the arguments Triton would see as multiples of 16 at launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fp4kit.kernels.backend import interpreted, launch_options

    if interpreted(fn):
        raise RuntimeError("sass_loop compiles kernels for sm_90: run it without TRITON_INTERPRET=1")
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name in divisible}
    kernel = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, **launch_options()})
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([str(tools / "cuobjdump"), "--dump-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1)), sass


FP8_GEMV_TILES = ((4, 512, 4), (8, 512, 4), (16, 512, 4), (8, 256, 2), (16, 256, 4), (4, 256, 2), (2, 512, 2),
                  (4, 1024, 4))


def fp8_gemv(rows=(1, 2, 4), tiles=FP8_GEMV_TILES) -> list:
    """`_fp8_gemv_kernel`'s K loop per (activation rows per program, BLOCK_N, BLOCK_K, warps), as a
    launch on the Mamba projections specialises it (K, N and the strides multiples of 16; one row:
    M = 1, a constant)."""
    from fp4kit.kernels import fp8_gemm as fg

    sig = {"x_ptr": "*u8", "w_ptr": "*u8", "xs_ptr": "*fp32", "ws_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32",
           "N": "i32", "K": "i32", "stride_xm": "i32", "stride_om": "i32", "BLOCK_M": "constexpr",
           "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "EVEN_K": "constexpr", "NATIVE": "constexpr"}
    divisible = ("x_ptr", "w_ptr", "xs_ptr", "ws_ptr", "out_ptr", "N", "K", "stride_xm", "stride_om")
    out = []
    for bm in rows:
        for bn, bk, nw in tiles:
            s, consts = dict(sig), dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=True, NATIVE=True)
            if bm == 1:
                s["M"], consts["M"] = "constexpr", 1
            regs, sass = compile_sm90(fg._fp8_gemv_kernel, s, consts, nw, divisible)
            ops = loop_ops(sass)
            weights = bn * bk / (32 * nw)  # per thread and loop step
            out.append({"rows": bm, "tile": [bn, bk, nw], "registers": regs, "loop_instructions": sum(ops.values()),
                        "per_weight": round(sum(ops.values()) / weights, 3), "ops": ops})
    return out


KERNELS = {"fp8-gemv": fp8_gemv}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", choices=sorted(KERNELS))
    ap.add_argument("--out", help="write the rows as JSON (date, command, versions) here")
    args = ap.parse_args(argv)
    rows = KERNELS[args.kernel]()
    print(f"{'rows':>4} {'tile (N, K, warps)':>20} {'regs':>5} {'loop':>5} {'per weight':>10}  shared-memory ops")
    for r in rows:
        smem = {k: v for k, v in r["ops"].items() if k in ("BAR", "STS", "STSM", "LDS", "PRMT")}
        print(f"{r['rows']:>4} {str(tuple(r['tile'])):>20} {r['registers']:>5} {r['loop_instructions']:>5} "
              f"{r['per_weight']:>10}  {smem}")
    if args.out:
        from benchlib.record import run_record

        record = run_record(None if argv is None else [str(ROOT / "scripts" / "sass_loop.py"), *argv])
        record["versions"]["target"] = "sm_90 (ahead of time, no GPU)"
        Path(args.out).write_text(json.dumps({**record, "kernel": args.kernel, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
