"""Check, tune and time the pre-packed W4A16 GEMM (fp4kit.kernels.packed_gemm) on a GPU.

Checks first (bit-exact decoded weights for every code and scale byte, bf16 and fp16; GEMM
outputs against an fp32 reference), then sweeps the launch shapes (scripts/sweeps/packed.py:
`sweep`, and `pick` into a candidate "packed" launch table, which the timing below uses; the
tuning file is not changed: scripts/tune_kernels.py packed.launch writes it), then times, side by side in one process and replayed from CUDA graphs:
torch.matmul on the bf16 weight, `w4a16_matmul` on the checkpoint layout and `packed_matmul` on
the packed weight. Writes JSON (default benchmarks/results/packed-gemm-<gpu>.json) and prints a
table.

    PYTHONPATH=. python scripts/bench_packed.py [--out PATH] [--no-sweep] [--ms 1,4,16,64,256,1024] [--pipeline]
        [--shapes 3712x2688,2688x3712] [--overlap] [--cold] [--chain] [--ws] [--rows] [--cluster] [--cluster-rows]

--cold sweeps the 16-64-row launch shapes with every launch reading its weight from device memory
(copies of the weight, four L2s in all, run in turn: a decode step's condition) and times the
GEMMs warm and cold with the table and that pick (default JSON packed-gemm-cold-<gpu>.json).

--chain times `packed_matmul` against the number of K tiles each program runs (3712 weight rows;
1, 16 and 64 activation rows; unsplit and split 4 ways; warm and cold) and fits a line per case:
what a launch costs whatever its K, and what each K tile adds (default JSON
packed-gemm-chain-<gpu>.json).

--ws times the Gluon kernel with K split across each program's warpgroups
(fp4kit.kernels.packed_ws) against torch.matmul and packed_matmul, warm and cold, with its error
against the fp32 product (default JSON packed-gemm-ws-<gpu>.json).

--rows times, at 1-64 activation rows, every W4A16 kernel a decode step could run on the weight
(checkpoint layout, packed_matmul, packed_ws at its launch shapes, packed_cluster at its default)
against torch.matmul, warm and cold, and prints the fastest per row count (default JSON
packed-gemm-rows-<gpu>.json).

--cluster times the CUDA C++ kernel with K split over a thread block cluster
(fp4kit.kernels.packed_cluster) at its launch shapes, and at its default launch with the
activation tiles unswizzled or a stage left out, against torch.matmul and packed_linear, warm and
cold, at 16-64 rows (default JSON packed-cluster-<gpu>.json). --cluster-rows does the same at the
launch shapes of benchlib/packed.py's ROW_CLUSTER_LAUNCHES and its ROW_CLUSTER_MS rows (default JSON
packed-cluster-rows-<gpu>.json).

--overlap times only the Gluon kernel with overlapped K tiles (fp4kit.kernels.packed_overlap)
against torch.matmul and packed_matmul, checking its bytes against packed_matmul's (sweeps/packed.py's
sweep_overlap; default JSON packed-gemm-overlap-<gpu>.json).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from bench_kernels import run_record, write
from benchlib.packed import (EVERY_M, ROW_CLUSTER_LAUNCHES, ROW_CLUSTER_MS, bench, bench_chain, bench_cluster, bench_cold,
                             bench_rows, bench_ws, chain_fits)
from sweeps import packed as sweeps

from fp4kit.formats import e2m1, nvfp4
from fp4kit.kernels import launch, packed_gemm as pg
from fp4kit.kernels.quantize import quantize


def random_weight(n: int, k: int, seed: int = 0) -> nvfp4.NVFP4Tensor:
    """Every code and every positive finite E4M3 scale byte, at random positions."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, device="cuda", dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(1, 127, (n, k // 16), generator=g, device="cuda", dtype=torch.int32).to(torch.uint8)
    return nvfp4.NVFP4Tensor(packed, scales.view(torch.float8_e4m3fn), torch.tensor(0.013, device="cuda"))


def check() -> dict:
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        w = random_weight(512, 1024)
        p = pg.pack(w, dtype)
        back = p.unpack()
        assert torch.equal(back.packed, w.packed) and torch.equal(back.block_scale.view(torch.uint8),
                                                                  w.block_scale.view(torch.uint8))
        got = pg.fragments(p).float()
        want = (e2m1.decode(w.codes()).reshape(512, -1, 16) * w.block_scale.float().unsqueeze(-1)
                * 2.0 ** -7).reshape(512, 1024)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), "decoded weights differ"
        for n, k, m in ((512, 1024, 64), (200, 1008, 37), (3712, 2688, 16), (64, 128, 1)):
            wq = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
            pq = pg.pack(wq, dtype)
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            ref = x.float() @ wq.dequantize().T
            for cfg in ({}, {"num_warps": 8}, {"SPLIT": 3}, {"SPLIT": 3, "UNROLL": 2}):
                y = pg.packed_matmul(x, pq, cfg=cfg)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                assert err < 1e-2, (n, k, m, cfg, err)
                out[f"{dtype}-{n}x{k}-m{m}-{cfg}"] = err
    return out


def shapes_arg(text: str) -> tuple:
    """"3712x2688,2688x3712" -> ((3712, 2688), (2688, 3712))."""
    try:
        shapes = tuple(tuple(int(v) for v in part.lower().split("x")) for part in text.split(","))
    except ValueError:
        shapes = ()
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"expected weight shapes as NxK[,NxK...], got {text!r}")
    return shapes


def print_rows(rows) -> None:
    print(f"{'N':>6} {'K':>5} {'M':>5} {'bf16 us':>8} {'w4a16 us':>9} {'packed us':>10} {'w4a16':>6} {'packed':>7}  packed launch")
    for r in rows:
        c = r["packed_launch"]
        print(f"{r['N']:>6} {r['K']:>5} {r['M']:>5} {r['ms_bf16'] * 1e3:>8.1f} {r['ms_w4a16'] * 1e3:>9.1f} "
              f"{r['ms_packed'] * 1e3:>10.1f} {r['speedup_vs_bf16']:>5.2f}x {r['speedup_vs_bf16_packed']:>6.2f}x  "
              f"BLOCK_M {c['BLOCK_M']} warps {c['num_warps']} split {c['SPLIT']} unroll {c['UNROLL']}")


def print_best(rows) -> None:
    """Per shape and M: bf16's warm / cold time, the fastest W4A16 kernel's and packed_matmul's as
    called by default (us), with their ratios to bf16's."""
    print(f"{'N':>5} {'K':>5} {'M':>3}  {'bf16 warm':>9} {'best warm':>9} {'x':>5}  {'bf16 cold':>9} {'best cold':>9} "
          f"{'x':>5}  {'dispatch warm / cold':>20} {'x':>11}  best warm kernel / best cold kernel")
    for key in sorted({(r["N"], r["K"], r["M"]) for r in rows}, key=lambda t: (-t[0], t[2])):
        mine = [r for r in rows if (r["N"], r["K"], r["M"]) == key]
        bf = next(r for r in mine if r["kernel"] == "bf16")
        cells, names = [], []
        for state in ("warm", "cold"):
            best = min((r for r in mine if r["kernel"] != "bf16"), key=lambda r: r[f"ms_{state}"])
            cells.append(f"{bf[f'ms_{state}'] * 1e3:>9.2f} {best[f'ms_{state}'] * 1e3:>9.2f} "
                         f"{bf[f'ms_{state}'] / best[f'ms_{state}']:>5.2f}")
            launch = best["launch"] or {}
            names.append(best["kernel"] + (f" BM{launch['BLOCK_M']} P{launch['P']} S{launch['SPLIT']}"
                                           if best["kernel"] == "ws" else ""))
        d = next(r for r in mine if r["kernel"] == "dispatch")
        disp = (f"{d['ms_warm'] * 1e3:>9.2f} / {d['ms_cold'] * 1e3:>8.2f} {bf['ms_warm'] / d['ms_warm']:>5.2f}/"
                f"{bf['ms_cold'] / d['ms_cold']:<5.2f}")
        print(f"{key[0]:>5} {key[1]:>5} {key[2]:>3}  {cells[0]}  {cells[1]}  {disp}  {names[0]} / {names[1]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/packed-gemm-<gpu>.json)")
    ap.add_argument("--no-sweep", action="store_true", help="measure with the tuning file's launch shapes as they are")
    ap.add_argument("--ms", default=None,
                    help="activation rows of the timed problems (default 1,4,16,64,256,1024; --rows: EVERY_M)")
    ap.add_argument("--shapes", default=None, type=shapes_arg,
                    help="weight shapes NxK to sweep and time, comma-separated (default: sweeps/packed.py's SHAPES)")
    ap.add_argument("--pipeline", action="store_true",
                    help="only time the software-pipelined and TMA variants against the plain loop "
                         "(sweeps/packed.py's sweep_pipeline; default JSON packed-gemm-pipeline-<gpu>.json)")
    ap.add_argument("--cold", action="store_true",
                    help="only sweep the launch shapes of 16-64 rows with cold weights (default shapes: Nano's "
                         "shared experts), then time torch.matmul, w4a16_matmul and packed_matmul (the tuning "
                         "file's table and the cold pick) warm and cold (benchlib/packed.py's bench_cold; "
                         "default JSON packed-gemm-cold-<gpu>.json)")
    ap.add_argument("--overlap", action="store_true",
                    help="only time the Gluon kernel with overlapped K tiles against torch.matmul and packed_matmul")
    ap.add_argument("--chain", action="store_true",
                    help="only time packed_matmul against the K tiles per program and fit a line per case "
                         "(benchlib/packed.py's bench_chain; default JSON packed-gemm-chain-<gpu>.json)")
    ap.add_argument("--ws", action="store_true",
                    help="only time the Gluon kernel with K split across each program's warpgroups "
                         "(benchlib/packed.py's bench_ws; default JSON packed-gemm-ws-<gpu>.json)")
    ap.add_argument("--rows", action="store_true",
                    help="only time every W4A16 kernel at 1-64 activation rows (EVERY_M, or --ms) against "
                         "torch.matmul, warm and cold (benchlib/packed.py's bench_rows; default JSON "
                         "packed-gemm-rows-<gpu>.json)")
    ap.add_argument("--cluster", action="store_true",
                    help="only time packed_cluster at its launch shapes and with stages left out, at 16-64 "
                         "activation rows, against torch.matmul and packed_linear, warm and cold "
                         "(benchlib/packed.py's bench_cluster; default JSON packed-cluster-<gpu>.json)")
    ap.add_argument("--cluster-rows", action="store_true",
                    help="as --cluster, at the launch shapes of ROW_CLUSTER_LAUNCHES (the wgmma's N at the rows "
                         "rounded up to 8, two warpgroups per block, blocks of 32 rows) and ROW_CLUSTER_MS rows "
                         "(default JSON packed-cluster-rows-<gpu>.json)")
    args = ap.parse_args()
    if args.cluster or args.cluster_rows:
        path, result = run_record("packed-cluster" + ("-rows" if args.cluster_rows else ""), args.out)
        kw = {"launches": ROW_CLUSTER_LAUNCHES, "variants": (), "ms": ROW_CLUSTER_MS} if args.cluster_rows else {}
        if args.ms is not None:
            kw["ms"] = tuple(int(v) for v in args.ms.split(","))
        result["cluster"] = bench_cluster(shapes=args.shapes or sweeps.NANO, **kw)
        write(path, result)
        print(f"wrote {path}")
        return
    if args.rows:
        path, result = run_record("packed-gemm-rows", args.out)
        ms = EVERY_M if args.ms is None else tuple(int(v) for v in args.ms.split(","))
        result["rows"] = rows = bench_rows(shapes=args.shapes or sweeps.NANO, ms=ms)
        write(path, result)
        print_best(rows)
        print(f"wrote {path}")
        return
    if args.ws:
        path, result = run_record("packed-gemm-ws", args.out)
        result["ws"] = rows = bench_ws(shapes=args.shapes or sweeps.NANO)
        write(path, result)
        print(f"{'N':>5} {'K':>5} {'M':>3}  {'kernel':<36} {'warm us':>8} {'cold us':>8} {'rel err':>9}")
        for r in rows:
            name = r["kernel"] + (f" {json.dumps(r['cfg'])}" if "cfg" in r else "")
            print(f"{r['N']:>5} {r['K']:>5} {r['M']:>3}  {name:<36} {r['ms_warm'] * 1e3:>8.2f} {r['ms_cold'] * 1e3:>8.2f} "
                  f"{r.get('rel_err', float('nan')):>9.2e}")
        print(f"wrote {path}")
        return
    if args.chain:
        path, result = run_record("packed-gemm-chain", args.out)
        result["chain"] = rows = bench_chain()
        result["fits"] = fits = chain_fits(rows)
        write(path, result)
        print(f"{'M':>3} {'variant':>10} {'split':>5} {'state':>5} {'fixed us':>9} {'us/tile':>8} {'resid':>6}  us at 1..8 tiles"
              f" (bf16 at the same K)")
        for f in fits:
            pts = sorted((r["tiles"], r[f"ms_{f['state']}"] * 1e3, r[f"ms_bf16_{f['state']}"] * 1e3) for r in rows
                         if (r["M"], r["variant"], r["SPLIT"]) == (f["M"], f["variant"], f["SPLIT"]))
            print(f"{f['M']:>3} {f['variant']:>10} {f['SPLIT']:>5} {f['state']:>5} {f['intercept_us']:>9.2f} "
                  f"{f['us_per_tile']:>8.2f} {f['max_residual_us']:>6.2f}  "
                  + " ".join(f"{t}:{v:.1f}({b:.1f})" for t, v, b in pts))
        print(f"wrote {path}")
        return
    if args.cold:
        path, result = run_record("packed-gemm-cold", args.out)
        shapes = args.shapes or sweeps.NANO
        tables = launch.table("packed")
        result["l2_bytes"] = torch.cuda.get_device_properties(0).L2_cache_size
        picked = None
        if not args.no_sweep:
            result["sweep_cold"] = sweeps.sweep(shapes=shapes, classes=(16, 32, 64), cold=True)
            picked = launch.override(tables, PACKED=sweeps.pick(result["sweep_cold"], tables))
            result["launch_shapes_cold_pick"] = launch.thaw(picked["PACKED"])
            print(f"cold pick: {json.dumps(result['launch_shapes_cold_pick'])}", flush=True)
        result["launch_shapes"] = launch.thaw(tables["PACKED"])
        ms = tuple(int(v) for v in (args.ms or "1,4,16,32,64").split(","))
        result["gemm_cold"] = rows = bench_cold(shapes=shapes, ms=ms,
                                               tables=tables, picked=picked)
        write(path, result)
        kinds = ("bf16", "w4a16", "packed") + (("packed_picked",) if picked else ())
        head = " ".join(f"{k[:9]:>9}" for k in kinds)
        print(f"{'N':>6} {'K':>5} {'M':>4}  warm: {head} {'best/bf16':>9}  cold: {head} {'best/bf16':>9}  (us)")
        for r in rows:
            cells = "  ".join(f"{state}: " + " ".join(f"{r[f'ms_{k}_{state}'] * 1e3:>9.1f}" for k in kinds)
                              + f" {r[f'speedup_vs_bf16_best_{state}']:>8.2f}x" for state in ("warm", "cold"))
            print(f"{r['N']:>6} {r['K']:>5} {r['M']:>4}  {cells}")
        print(f"wrote {path}")
        return
    if args.overlap:
        path, result = run_record("packed-gemm-overlap", args.out)
        kw = {"problems": tuple((n, k, m) for n, k in args.shapes for m in (16, 64))} if args.shapes else {}
        result["sweep_overlap"] = rows = sweeps.sweep_overlap(**kw)
        write(path, result)
        print(f"{'N':>6} {'K':>5} {'M':>4} {'bf16 us':>8} {'packed us':>10} {'overlap us':>11} {'vs bf16':>8}  best launch")
        for n, k, m in sorted({(r["N"], r["K"], r["M"]) for r in rows}):
            mine = [r for r in rows if (r["N"], r["K"], r["M"]) == (n, k, m)]
            ms = {r["kernel"]: r["ms"] for r in mine if r["kernel"] != "overlap"}
            best = min((r for r in mine if r["kernel"] == "overlap"), key=lambda r: r["ms"])
            print(f"{n:>6} {k:>5} {m:>4} {ms['bf16'] * 1e3:>8.1f} {ms['packed'] * 1e3:>10.1f} {best['ms'] * 1e3:>11.1f} "
                  f"{ms['bf16'] / best['ms']:>7.2f}x  STAGES {best['STAGES']} split {best['SPLIT']} AHEAD {best['AHEAD']} "
                  f"PREFETCH {best['PREFETCH']} "
                  f"equal {all(r['equal'] for r in mine if r['kernel'] == 'overlap')}")
        print(f"wrote {path}")
        return
    if args.pipeline:
        path, result = run_record("packed-gemm-pipeline", args.out)
        result["sweep_pipeline"] = sweeps.sweep_pipeline()
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
        return
    path, result = run_record("packed-gemm", args.out)
    result["check_rel_err"] = check()
    print("checks passed", flush=True)
    shapes = args.shapes or sweeps.SHAPES
    tables = launch.table("packed")
    if not args.no_sweep:
        result["sweep"] = sweeps.sweep(shapes=shapes)
        tables = launch.override(tables, PACKED=sweeps.pick(result["sweep"], tables))
    result["launch_shapes"] = launch.thaw(tables["PACKED"])
    print(f"launch shapes: {json.dumps(result['launch_shapes'])}", flush=True)
    ms = tuple(int(v) for v in (args.ms or "1,4,16,64,256,1024").split(","))
    result["gemm"] = bench(shapes=shapes, ms=ms, tables=tables)
    print_rows(result["gemm"])
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
