"""W4A16 GEMM on a pre-packed NVFP4 weight with the split of K inside each program (Gluon, sm_90).

`packed_gemm._packed_kernel` splits K across programs: each stores its fp32 partial to global
memory and counts itself in at its tile's counter, and the last to arrive reads the others' back
and sums them (`tiles.store_split`). At 16-64 rows on the Nano shapes that epilogue costs about as
much as the K tiles themselves (benchmarks/README.md, results/split-epilogue-h100.json). Here one
program of P warpgroups (P = 2 or 4, `gl.warp_specialize`: a default partition and P - 1 workers
of 4 warps each) takes a tile's whole K range (or its share of a split across programs, SPLIT), for
one warpgroup's 64 weight rows and BLOCK_M activation rows; warpgroup p runs the program's K tiles
p, p + P, p + 2P, ... in order:

- the activation tiles come by TMA into the warpgroup's own XS shared-memory buffers, the first XS
  issued before its loop, each later one into the buffer the tile XS before has finished with,
  where there is a later one (a refill is the warpgroup's to agree on; a tile without one skips it);
- a tile's codes and scales are loaded one tile ahead of their decoding, and each of its eight
  16-wide chunks is issued to the matrix units (an asynchronous wgmma) as soon as it is decoded,
  so that the next chunk's decoding runs while it does; the tile's wgmma are waited for together;
- the loop takes XS tiles a step, one per buffer, so that each buffer's index, and with it its
  wgmma operand descriptors, is a constant: built once, not for every wgmma.

The workers then put their fp32 sums in shared memory and arrive at one mbarrier; the default
partition adds them to its own in the fixed order p = 1, 2, ..., so no partial goes through global
memory and nothing waits on an atomic, unless SPLIT > 1 (then `tiles.store_split` as usual).

The weight layout and decoding are `packed_gemm`'s (`packed_overlap._tile_load` /
`_group_chunks`); every sum is in a fixed order, so a launch shape always gives the same bytes, but
not `packed_matmul`'s (its K tiles are summed in one chain). `packed_linear.packed_linear`, which
the modules call, hands it 16-64 rows of a small weight on an sm_90 GPU, where its programs fill
the GPU or `packed_matmul` would run blocks of 32 rows (`packed_linear.ws_rows`), and where
`packed_cluster` does not take them first (`packed_linear.cluster_rows`).
A last block of rows that M does not fill ends at row M (moved back over rows of the block before,
which it does not store), so that no activation tile reads past the last row. Measured against
`packed_matmul` and bf16: benchmarks/README.md. Gluon compiles for NVIDIA GPUs only (Triton's
interpreter does not run it): on a CPU the launcher refuses.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from . import backend
from .backend import cdiv, launch_options, next_power_of_2
from .packed_gemm import TILE_K, PackedNVFP4
from .packed_overlap import (_group_chunks, _offsets, _tile_load, _tma_load, gluon_rows, split_partials, store_product,
                             x_descriptor)

_WHAT = "kernels.packed_matmul_ws"
WARPS = 4  # warps per warpgroup: 64 weight rows per program, 16 per warp
W = gl.constexpr(WARPS)
# A barrier of one partition's warps: `thread_barrier` up to Triton 3.6, `barrier` after.
_partition_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier


@gluon.jit
def _frag(o, a_layout: gl.constexpr, W: gl.constexpr):
    """A chunk's [w, g, c, kh, rs, h] values as its wgmma A fragment [16 W, 16] (no data moved:
    asserted): row 16 w + 8 rs + g, K 8 kh + 2 c + h."""
    q = gl.reshape(gl.permute(o, (0, 4, 1, 3, 2, 5)), (16 * W, 16))
    return gl.convert_layout(q, a_layout, assert_trivial=True)


@gluon.jit
def _group_mma(words, sc, xb, k0: gl.constexpr, acc, a_layout: gl.constexpr, W: gl.constexpr, F16: gl.constexpr):
    """One group's four chunks (K k0 to k0 + 63 of the tile), each chunk's wgmma issued as soon as it
    is decoded, on the activation buffer xb's 16 columns: (acc in flight, the four fragments)."""
    o0, o1, o2, o3 = _group_chunks(words, sc, W, F16)
    f0 = _frag(o0, a_layout, W)
    acc = warpgroup_mma(f0, xb.slice(k0, 16, dim=1).permute((1, 0)), acc, is_async=True)
    f1 = _frag(o1, a_layout, W)
    acc = warpgroup_mma(f1, xb.slice(k0 + 16, 16, dim=1).permute((1, 0)), acc, is_async=True)
    f2 = _frag(o2, a_layout, W)
    acc = warpgroup_mma(f2, xb.slice(k0 + 32, 16, dim=1).permute((1, 0)), acc, is_async=True)
    f3 = _frag(o3, a_layout, W)
    acc = warpgroup_mma(f3, xb.slice(k0 + 48, 16, dim=1).permute((1, 0)), acc, is_async=True)
    return acc, f0, f1, f2, f3


@gluon.jit
def _tile_mma(w0, s0, w1, s1, xb, acc, a_layout: gl.constexpr, W: gl.constexpr, F16: gl.constexpr):
    """acc + a K tile's product: its 16-wide chunks decoded one after another, each chunk's wgmma
    issued as soon as it is, all waited for at the end, the fragments kept live until then."""
    acc, f0, f1, f2, f3 = _group_mma(w0, s0, xb, 0, acc, a_layout, W, F16)
    acc, f4, f5, f6, f7 = _group_mma(w1, s1, xb, 64, acc, a_layout, W, F16)
    acc, f0, f1, f2, f3, f4, f5, f6, f7 = warpgroup_mma_wait(0, deps=(acc, f0, f1, f2, f3, f4, f5, f6, f7))
    return acc


@gluon.jit
def _share(x_desc, w_ptr, s_ptr, xs, bars, N16, KT, kt0, n_k, pid_n, row0, P: gl.constexpr, p: gl.constexpr):
    """Warpgroup p's sum over the program's K tiles kt0 + p, kt0 + p + P, ... (below kt0 + n_k), in
    order: acc [64, BLOCK_M] fp32 in the wgmma accumulator layout. Its activation tiles come by TMA
    into the program's buffers xs[XS p], ..., xs[XS p + XS - 1] ([XS P, BLOCK_M, 128]), each with its
    mbarrier in bars. (Constants, the activation dtype among them, reach a partition through its
    buffers' shapes and types: `gl.warp_specialize` passes its arguments as values.)"""
    BLOCK_M: gl.constexpr = xs.type.shape[1]
    XS: gl.constexpr = xs.type.shape[0] // P
    F16: gl.constexpr = s_ptr.dtype.element_ty == gl.float16
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    mine = gl.maximum(n_k - p + (P - 1), 0) // P
    for j in gl.static_range(XS):
        ok = j < mine
        mbarrier.expect(bars.index(XS * p + j), x_desc.block_type.nbytes, pred=ok)
        _tma_load(x_desc, [row0, (kt0 + p + j * P) * 128], bars.index(XS * p + j), xs.index(XS * p + j), pred=ok)
    woff, soff = _offsets(pid_n, N16, KT, W)
    acc = gl.zeros([16 * W, BLOCK_M], gl.float32, layout=mma_layout)
    # A tile's codes and scales are loaded one step ahead of their decoding (past the program's
    # last tile, or for a warpgroup with none, the weight's last tile again: nothing uses them).
    last = KT - 1
    w0, s0, w1, s1 = _tile_load(w_ptr, s_ptr, woff, soff, gl.minimum(kt0 + p, last))
    for i0 in range(0, mine, XS):
        for j in gl.static_range(XS):  # unrolled: each buffer's index, and so its wgmma operands, constant
            i = i0 + j
            if i < mine:
                kt = kt0 + p + i * P
                n0, n1, n2, n3 = _tile_load(w_ptr, s_ptr, woff, soff, gl.minimum(kt + P, last))
                buf: gl.constexpr = XS * p + j
                mbarrier.wait(bars.index(buf), (i0 // XS) & 1)
                acc = _tile_mma(w0, s0, w1, s1, xs.index(buf), acc, a_layout, W, F16)
                w0, s0, w1, s1 = n0, n1, n2, n3
                if i + XS < mine:  # this buffer's wgmma are done: refill it with the tile XS on
                    mbarrier.expect(bars.index(buf), x_desc.block_type.nbytes)
                    _tma_load(x_desc, [row0, (kt + XS * P) * 128], bars.index(buf), xs.index(buf))
    return acc


@gluon.jit
def _worker_sum(x_desc, w_ptr, s_ptr, xs, bars, sums, done, N16, KT, kt0, n_k, pid_n, row0, p: gl.constexpr):
    """Warpgroup p >= 1: its sum into shared memory (sums[p - 1]), then one arrival at `done`."""
    acc = _share(x_desc, w_ptr, s_ptr, xs, bars, N16, KT, kt0, n_k, pid_n, row0, sums.type.shape[0] + 1, p)
    sums.index(p - 1).store(acc)
    _partition_barrier()  # every thread's part stored before the one arrival
    mbarrier.arrive(done.index(0))


@gluon.jit
def _worker1(x_desc, w_ptr, s_ptr, xs, bars, sums, done, N16, KT, kt0, n_k, pid_n, row0):
    _worker_sum(x_desc, w_ptr, s_ptr, xs, bars, sums, done, N16, KT, kt0, n_k, pid_n, row0, 1)


@gluon.jit
def _worker2(x_desc, w_ptr, s_ptr, xs, bars, sums, done, N16, KT, kt0, n_k, pid_n, row0):
    _worker_sum(x_desc, w_ptr, s_ptr, xs, bars, sums, done, N16, KT, kt0, n_k, pid_n, row0, 2)


@gluon.jit
def _worker3(x_desc, w_ptr, s_ptr, xs, bars, sums, done, N16, KT, kt0, n_k, pid_n, row0):
    _worker_sum(x_desc, w_ptr, s_ptr, xs, bars, sums, done, N16, KT, kt0, n_k, pid_n, row0, 3)


@gluon.jit
def _default(x_desc, w_ptr, s_ptr, xs, bars, sums, done, N16, KT, kt0, n_k, pid_n, row0):
    """Warpgroup 0: its own sum, then the workers' added in the order p = 1, 2, ..."""
    P: gl.constexpr = sums.type.shape[0] + 1
    acc = _share(x_desc, w_ptr, s_ptr, xs, bars, N16, KT, kt0, n_k, pid_n, row0, P, 0)
    mbarrier.wait(done.index(0), 0)
    for q in gl.static_range(1, P):
        acc = acc + sums.index(q - 1).load(acc.type.layout)
    return (acc,)


@gluon.jit
def _ws_kernel(x_desc, w_ptr, s_ptr, gs_ptr, out_ptr, part_ptr, cnt_ptr, M, N, N16, KT, kt_per_split,
               BLOCK_M: gl.constexpr, SPLIT: gl.constexpr, P: gl.constexpr, XS: gl.constexpr,
               WORKER_REGS: gl.constexpr):
    """out[M, N] = x @ W^T for W a `PackedNVFP4`; grid: (N16 / 4, M / BLOCK_M, SPLIT), 4 warps in the
    default partition and P - 1 workers of 4, XS activation buffers per warpgroup (module
    docstring)."""
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_s = gl.program_id(2)
    kt0 = pid_s * kt_per_split
    n_k = gl.minimum(kt_per_split, KT - kt0)
    # A last block of rows that M does not fill is moved back to end at row M where M allows (its
    # rows below pid_m * BLOCK_M, the block before's, are not stored): a TMA box that reaches past
    # the activations' last row takes longer (benchmarks/README.md).
    first = pid_m * BLOCK_M
    row0 = gl.maximum(gl.minimum(first, M - BLOCK_M), 0)
    xs = gl.allocate_shared_memory(x_desc.dtype, [XS * P, BLOCK_M, 128], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [XS * P, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    sums_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    sums = gl.allocate_shared_memory(gl.float32, [P - 1, 16 * W, BLOCK_M], sums_layout)
    for j in gl.static_range(XS * P):
        mbarrier.init(bars.index(j), count=1)
    mbarrier.init(done.index(0), count=P - 1)
    args = (x_desc, w_ptr, s_ptr, xs, bars, sums, done, N16, KT, kt0, n_k, pid_n, row0)
    if P == 2:
        (acc,) = gl.warp_specialize([(_default, args), (_worker1, args)], [W], [WORKER_REGS])
    else:
        (acc,) = gl.warp_specialize([(_default, args), (_worker1, args), (_worker2, args), (_worker3, args)],
                                    [W, W, W], [WORKER_REGS, WORKER_REGS, WORKER_REGS])
    store_product(acc, gs_ptr, out_ptr, part_ptr, cnt_ptr, M, N, pid_m, pid_n, pid_s, row0, SPLIT, first)


LAUNCH_KEYS = ("BLOCK_M", "P", "SPLIT", "XS", "WORKER_REGS")
BLOCK_MS = (16, 32, 64)
MAX_XS = 8
SMEM_BYTES = 232448  # an sm_90 program's shared memory at most (227 KiB)


def smem_bytes(block_m: int, p: int, xs: int) -> int:
    """A program's shared memory: XS activation tiles [BLOCK_M, 128] per warpgroup, the workers'
    fp32 sums [64, BLOCK_M] and the mbarriers."""
    return xs * p * block_m * TILE_K * 2 + (p - 1) * 16 * WARPS * block_m * 4 + 8 * (xs * p + 1)


def config(m: int, n: int, k: int, cfg: dict | None = None, sms: int | None = None) -> dict:
    """Launch shape for one problem: BLOCK_M (16, 32 or 64), P (warpgroups per program, 2 or 4,
    default 4), SPLIT (programs per tile along K), XS (activation buffers per warpgroup, 2 to 8,
    default 2: more took longer, the shared memory they take being the L1 cache's that the codes
    are loaded through, and each a tile's code more in the loop) and WORKER_REGS (registers per
    thread, every partition's: 128 for 4 warpgroups, 168 for 2, within the 64 K registers of a
    multiprocessor, without spills), overridden by cfg.

    Default BLOCK_M and SPLIT, for a GPU of `sms` multiprocessors: the grid in one wave. BLOCK_M is
    the smaller of 16 and 32 whose programs (N / 64 by M / BLOCK_M) all fit at once (32 where none
    does: each program decodes its weight rows whatever its BLOCK_M, so more of them decode the
    weight more often, but in parallel), and SPLIT 2 where twice those programs still fit, else
    1 (an unsplit program sums in shared memory; a split one goes through global memory). Without
    `sms`: half of M rounded up to a power of two, 16 to 32, unsplit."""
    c = dict(cfg or {})
    unknown = set(c) - set(LAUNCH_KEYS)
    if unknown:
        raise ValueError(f"{_WHAT}: unknown launch keys {sorted(unknown)}; expected some of {LAUNCH_KEYS}")
    tiles_n = cdiv(n, 16 * WARPS)
    if c.get("BLOCK_M"):
        bm = c["BLOCK_M"]
    elif sms is None:
        bm = min(max(16, next_power_of_2(m) // 2), 32)
    else:
        bm = 16 if tiles_n * cdiv(m, 16) <= sms else 32
    p = c.get("P", 4)
    if "SPLIT" in c:
        split = c["SPLIT"]
    else:
        split = 2 if sms is not None and 2 * tiles_n * cdiv(m, bm) <= sms else 1
    regs = c.get("WORKER_REGS", 128 if p == 4 else 168)
    if bm not in BLOCK_MS or p not in (2, 4) or split < 1 or regs % 8 or not 24 <= regs <= 256:
        raise ValueError(f"{_WHAT}: BLOCK_M must be one of {BLOCK_MS}, P 2 or 4, SPLIT >= 1 and WORKER_REGS a "
                         f"multiple of 8 from 24 to 256, got {bm}, {p}, {split}, {regs}")
    kt = cdiv(k, TILE_K)
    per = cdiv(kt, min(split, kt))
    xs = c.get("XS", 2)
    if not 2 <= xs <= MAX_XS:
        raise ValueError(f"{_WHAT}: XS must be 2 to {MAX_XS}, got {xs}")
    if smem_bytes(bm, p, xs) > SMEM_BYTES:
        raise ValueError(f"{_WHAT}: BLOCK_M {bm}, P {p} and XS {xs} need {smem_bytes(bm, p, xs)} bytes of shared "
                         f"memory, more than a program has ({SMEM_BYTES})")
    return {"BLOCK_M": bm, "P": p, "SPLIT": cdiv(kt, per), "kt_per_split": per, "XS": xs, "WORKER_REGS": regs}


def launch_grid(m: int, n: int, c: dict) -> tuple:
    """The grid of a launch of `config` c on an [m, k] @ [n, k]^T problem: (N / 64, M / BLOCK_M, SPLIT)."""
    return cdiv(n, 16 * WARPS), cdiv(m, c["BLOCK_M"]), c["SPLIT"]


@functools.lru_cache(maxsize=4096)
def _default_config(m: int, n: int, k: int, sms: int) -> dict:
    """`config` without overrides, kept per problem shape (the caller must not change it)."""
    return config(m, n, k, None, sms)


def packed_matmul_ws(x: torch.Tensor, w: PackedNVFP4, *, cfg: dict | None = None) -> torch.Tensor:
    """y = x @ W.unpack().dequantize(x.dtype)^T on an sm_90 GPU, fp32 accumulation, output in x's
    dtype, with K split across the warpgroups of each program (module docstring). x and w as
    `packed_overlap.packed_matmul_overlapped` takes them; cfg: launch-shape overrides (`config`)."""
    lead, x2, out = gluon_rows(x, w, _WHAT)
    n, k = w.shape
    m = x2.shape[0]
    if m == 0:
        return out.reshape(*lead, n)
    sms = backend.sm_count(x.device)
    c = _default_config(m, n, k, sms) if cfg is None else config(m, n, k, cfg, sms)
    n16, kt = w.words.shape[:2]
    grid = launch_grid(m, n, c)
    desc = x_descriptor(x2, c["BLOCK_M"])
    part, counters = split_partials(out, c["SPLIT"], grid)
    _ws_kernel[grid](desc, w.words, w.scales, w.global_scale, out, part, counters, m, n, n16, kt, c["kt_per_split"],
                     BLOCK_M=c["BLOCK_M"], SPLIT=c["SPLIT"], P=c["P"], XS=c["XS"], WORKER_REGS=c["WORKER_REGS"],
                     num_warps=WARPS, maxnreg=c["WORKER_REGS"], **launch_options())
    return out.reshape(*lead, n)
