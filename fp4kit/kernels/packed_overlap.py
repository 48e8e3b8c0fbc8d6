"""W4A16 GEMM on a pre-packed NVFP4 weight with its K tiles overlapped (Gluon, sm_90).

`packed_gemm._packed_kernel` runs each K tile as a chain: load the tile's codes and scales, decode
them in registers, copy the activation tile to shared memory, wait for every warp at a barrier,
run the tile's eight wgmma and wait for them; Triton's own pipeliner does not overlap that chain
across tiles (it gives each K-16 slice of a register-operand dot its own wait). This kernel,
written in Gluon, states the overlap itself, for one warpgroup (64 weight rows) per program:

- the activation tiles [BLOCK_M, 128] come by TMA into a ring of STAGES shared-memory buffers,
  each with its own mbarrier: no barrier across the warps for them, each copy issued STAGES - 1
  tiles ahead of its use;
- a tile's codes and scales are loaded into registers AHEAD (2 or 3) tiles before its wgmma, and
  optionally prefetched to L2 PREFETCH tiles before;
- the eight wgmma of tile i are issued asynchronously and the codes of tile i + 1 decoded while
  they run (into other registers: tile i's fragments stay live until the wait that retires them).

The weight layout, the decoding (`packed_gemm.decode_asm`) and the order of every sum are those of
`_packed_kernel`: K tiles in order, eight K-16 wgmma per tile, split-K partials summed in a fixed
order in the same launch (`tiles.store_split`). So with the same BLOCK_M and split the two kernels
give the same bytes (tests/gpu/test_packed_overlap_gpu.py). The decoded A tile must be the wgmma
fragment layout without data movement: the kernel asserts that when it compiles
(`convert_layout(..., assert_trivial=True)`).

Measured on an H200 it is slower than `packed_matmul` on every timed problem, so nothing calls it
by default (benchmarks/README.md, results/packed-gemm-overlap-h200.json). Gluon compiles for
NVIDIA GPUs only (Triton's interpreter does not run it): on a CPU the launcher refuses.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fp4kit.formats.errors import FormatError

from . import backend
from .backend import cdiv, check_activations, launch_options, next_power_of_2
from .mma import _PREFETCH_ASM, MMA_UNSCALE
from .packed_gemm import SLAB, TILE_K, PackedNVFP4, decode_asm, tma_ready
from .tiles import activation_rows, split_counters, store_split

_WHAT = "kernels.packed_matmul_overlapped"
WARPS = 4  # one warpgroup: 64 weight rows per program, 16 per warp
_DECODE_BF16 = gl.constexpr(decode_asm("bf16"))
_DECODE_F16 = gl.constexpr(decode_asm("f16"))
# The TMA copy into shared memory: `async_load` from Triton 3.7 on, `async_copy_global_to_shared` before.
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared


@gluon.jit
def _offsets(pid_n, N16, KT, W: gl.constexpr):
    """Per thread, its 8 halves of a group's words and its row pair's 8 scales at K tile 0
    (+ 512 kt, + 8 G for group G; scales + 128 kt + 8 G): `packed_gemm._offsets` in the load
    layout, one 16-byte vector per thread each."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [W, 1], [1, 0])
    t = gl.arange(0, 32 * W, layout=gl.SliceLayout(1, layout))
    e = gl.arange(0, 8, layout=gl.SliceLayout(0, layout))
    slab = gl.minimum(pid_n * W + t // 32, N16 - 1).to(gl.int64) * KT
    wline = (slab * 32 + t % 32) * 16
    sline = (slab * 8 + (t % 32) // 4) * 16
    return wline[:, None] + e[None, :], sline[:, None] + e[None, :]


@gluon.jit
def _prefetch(w_ptr, s_ptr, woff, soff, kt, ok):
    """An L2 prefetch of K tile kt's words and scales where ok (no register written): one
    address per thread of its 32 bytes of words and 16 of scales."""
    line_w = gl.max(woff, axis=1) - 7  # the thread's first half (its row of woff: 8 consecutive)
    line_s = gl.max(soff, axis=1) - 7
    flag = (line_w * 0 + ok).to(gl.int32)
    gl.inline_asm_elementwise(_PREFETCH_ASM, "=r,l,r", [w_ptr + line_w + kt * 512, flag], dtype=gl.int32,
                              is_pure=False, pack=1)
    gl.inline_asm_elementwise(_PREFETCH_ASM, "=r,l,r", [s_ptr + line_s + kt * 128, flag], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _tile_load(w_ptr, s_ptr, woff, soff, kt):
    """K tile kt's words and scales, both groups, as loaded."""
    w0 = gl.load(w_ptr + woff + kt * 512)
    s0 = gl.load(s_ptr + soff + kt * 128)
    w1 = gl.load(w_ptr + woff + (kt * 512 + 8))
    s1 = gl.load(s_ptr + soff + (kt * 128 + 8))
    return w0, s0, w1, s1


@gluon.jit
def _group_chunks(words, sc, W: gl.constexpr, F16: gl.constexpr):
    """One group's four chunks t = 0..3 decoded, each [w, g, c, kh, rs, h] (`packed_gemm._group`)."""
    words = gl.reshape(words, (W, 8, 4, 2, 2, 2))
    sc = gl.reshape(sc, (W, 8, 4, 1, 2, 2, 2))
    s01, s23 = gl.split(sc)
    # the scales' layout after the split is a slice of a wider one; the words' is the same map
    s01 = gl.broadcast(gl.convert_layout(s01, words.type.layout, assert_trivial=True), words)[0]
    s23 = gl.broadcast(gl.convert_layout(s23, words.type.layout, assert_trivial=True), words)[0]
    if F16:
        o0, o1, o2, o3 = gl.inline_asm_elementwise(_DECODE_F16, "=r,=r,=r,=r,r,r,r", [words, s01, s23],
                                                   dtype=(gl.float16,) * 4, is_pure=True, pack=2)
    else:
        o0, o1, o2, o3 = gl.inline_asm_elementwise(_DECODE_BF16, "=r,=r,=r,=r,r,r,r", [words, s01, s23],
                                                   dtype=(gl.bfloat16,) * 4, is_pure=True, pack=2)
    return o0, o1, o2, o3


@gluon.jit
def _group(words, sc, W: gl.constexpr, F16: gl.constexpr):
    """One group's four chunks as [w, g, c, kh, rs, h, t % 2, t // 2] (`packed_gemm._group`)."""
    o0, o1, o2, o3 = _group_chunks(words, sc, W, F16)
    return gl.join(gl.join(o0, o1), gl.join(o2, o3))


@gluon.jit
def _tile_decode(w0, s0, w1, s1, a_layout: gl.constexpr, W: gl.constexpr, F16: gl.constexpr):
    """A K tile's weights [16 W, 128] in the wgmma A-fragment layout (no data moved: asserted)."""
    q = gl.join(_group(w0, s0, W, F16), _group(w1, s1, W, F16))  # [.., h, t % 2, t // 2, G]
    q = gl.permute(q, (0, 4, 1, 8, 7, 6, 3, 2, 5))  # [w, rs, g, G, t // 2, t % 2, kh, c, h]
    q = gl.reshape(q, (16 * W, 128))
    return gl.convert_layout(q, a_layout, assert_trivial=True)


@gluon.jit
def store_product(acc, gs_ptr, out_ptr, part_ptr, cnt_ptr, M, N, pid_m, pid_n, pid_s, row0, SPLIT: gl.constexpr,
                  first=0):
    """The epilogue: acc [64, BLOCK_M] (weight rows by activation rows, in its wgmma layout) times
    the global scale and 2^7 (the fragments are E2M1 * scale * 2^-7), stored at out[row0:, 64 *
    pid_n:] or summed with the other K splits (`tiles.store_split`); activation rows below
    `first` (another program's) and from M on are not stored."""
    layout: gl.constexpr = acc.type.layout
    y = acc * (gl.load(gs_ptr) * MMA_UNSCALE)
    rows = pid_n * acc.shape[0] + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    toks = row0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    off = toks.to(gl.int64)[None, :] * N + rows[:, None]
    ok = ((toks < M) & (toks >= first))[None, :] & (rows < N)[:, None]
    if SPLIT == 1:
        gl.store(out_ptr + off, y.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        store_split(y, part_ptr, out_ptr, cnt_ptr, pid_m * gl.num_programs(0) + pid_n, off, ok, M * N, pid_s, SPLIT)


@gluon.jit
def _overlap_kernel(x_desc, w_ptr, s_ptr, gs_ptr, out_ptr, part_ptr, cnt_ptr, M, N, N16, KT, kt_per_split,
                    BLOCK_M: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr, F16: gl.constexpr,
                    AHEAD: gl.constexpr, PREFETCH: gl.constexpr):
    """out[M, N] = x @ W^T for W a `PackedNVFP4`; grid: (N16 / 4, M / BLOCK_M, SPLIT), 4 warps.
    acc [64, BLOCK_M] = W_tile @ x_tile^T in fp32 (weight rows by activation rows). A tile's
    codes and scales are loaded AHEAD (2 or 3) tiles before its wgmma, and asked of L2 PREFETCH
    tiles before (0: not)."""
    W: gl.constexpr = 4
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_s = gl.program_id(2)
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    kt0 = pid_s * kt_per_split
    n_k = gl.minimum(kt_per_split, KT - kt0)
    row0 = pid_m * BLOCK_M

    xs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, 128], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(bars.index(j), count=1)
    for j in gl.static_range(STAGES):
        ahead = j < n_k
        mbarrier.expect(bars.index(j), x_desc.block_type.nbytes, pred=ahead)
        _tma_load(x_desc, [row0, (kt0 + j) * 128], bars.index(j), xs.index(j), pred=ahead)

    woff, soff = _offsets(pid_n, N16, KT, W)
    if PREFETCH > 0:
        for j in gl.static_range(AHEAD, PREFETCH):
            _prefetch(w_ptr, s_ptr, woff, soff, kt0 + j, j < n_k)
    last = n_k - 1
    w0, s0, w1, s1 = _tile_load(w_ptr, s_ptr, woff, soff, kt0)
    a = _tile_decode(w0, s0, w1, s1, a_layout, W, F16)
    a_old = a
    # the queue of loaded tiles: p (the next), q (the one after, AHEAD 3 only)
    p0, p1, p2, p3 = _tile_load(w_ptr, s_ptr, woff, soff, kt0 + gl.minimum(1, last))
    q0, q1, q2, q3 = p0, p1, p2, p3
    if AHEAD == 3:
        q0, q1, q2, q3 = _tile_load(w_ptr, s_ptr, woff, soff, kt0 + gl.minimum(2, last))
    acc = gl.zeros([16 * W, BLOCK_M], gl.float32, layout=mma_layout)
    for i in range(n_k):
        # The codes of tile i + AHEAD, loaded first: their latency runs under this whole step.
        # Past the last tile the loads and the decoding repeat the last tile; nothing uses them.
        n0, n1, n2, n3 = _tile_load(w_ptr, s_ptr, woff, soff, kt0 + gl.minimum(i + AHEAD, last))
        if PREFETCH > 0:
            _prefetch(w_ptr, s_ptr, woff, soff, kt0 + i + PREFETCH, i + PREFETCH < n_k)
        stage = i % STAGES
        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
        acc = warpgroup_mma(a, xs.index(stage).permute((1, 0)), acc, is_async=True)
        # At most this tile's wgmma in flight: the tile before is done, its fragments (a_old) and
        # its activation stage free. This tile's fragments stay live (a_old next) until then.
        acc, a_old = warpgroup_mma_wait(1, deps=(acc, a_old))
        back = gl.maximum(i - 1, 0)
        refill = (i > 0) & (back + STAGES < n_k)
        mbarrier.expect(bars.index(back % STAGES), x_desc.block_type.nbytes, pred=refill)
        _tma_load(x_desc, [row0, (kt0 + back + STAGES) * 128], bars.index(back % STAGES), xs.index(back % STAGES),
                  pred=refill)
        a_old = a
        a = _tile_decode(p0, p1, p2, p3, a_layout, W, F16)  # the next tile, while this one's wgmma run
        if AHEAD == 3:
            p0, p1, p2, p3 = q0, q1, q2, q3
            q0, q1, q2, q3 = n0, n1, n2, n3
        else:
            p0, p1, p2, p3 = n0, n1, n2, n3
    acc, a_old = warpgroup_mma_wait(0, deps=(acc, a_old))
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(j))

    store_product(acc, gs_ptr, out_ptr, part_ptr, cnt_ptr, M, N, pid_m, pid_n, pid_s, row0, SPLIT)


LAUNCH_KEYS = ("BLOCK_M", "STAGES", "AHEAD", "PREFETCH", "SPLIT", "programs_per_sm")
BLOCK_MS = (16, 32, 64)  # 128 rows' accumulator and two tiles' fragments spill


def config(m: int, n: int, k: int, device: torch.device, cfg: dict | None = None) -> dict:
    """Launch shape for one problem: BLOCK_M (activation rows per program: M rounded up to a power
    of two, 16 to 64), STAGES (activation buffers, 2 to 4, default 3: while a tile's wgmma run,
    the tile before's buffer is refilled, so a copy is issued STAGES - 1 tiles ahead of its use)
    AHEAD (tiles of codes in registers ahead of their wgmma, 2 or 3, default 2), PREFETCH (L2
    prefetch distance in tiles, 0 to 8, default 0: none) and the split of K (default: enough
    programs for programs_per_sm per multiprocessor, default 2), overridden by cfg."""
    c = dict(cfg or {})
    unknown = set(c) - set(LAUNCH_KEYS)
    if unknown:
        raise ValueError(f"{_WHAT}: unknown launch keys {sorted(unknown)}; expected some of {LAUNCH_KEYS}")
    bm = c.get("BLOCK_M") or min(max(16, next_power_of_2(m)), 64)
    stages, ahead, prefetch = c.get("STAGES", 3), c.get("AHEAD", 2), c.get("PREFETCH", 0)
    if bm not in BLOCK_MS or stages not in (2, 3, 4) or ahead not in (2, 3) or prefetch not in range(9):
        raise ValueError(f"{_WHAT}: BLOCK_M must be one of {BLOCK_MS}, STAGES 2 to 4, AHEAD 2 or 3 and PREFETCH "
                         f"0 to 8, got {bm}, {stages}, {ahead}, {prefetch}")
    kt = cdiv(k, TILE_K)
    tiles = cdiv(cdiv(n, SLAB), WARPS) * cdiv(m, bm)
    split = c.get("SPLIT") or max(1, min(kt, backend.sm_count(device) * c.get("programs_per_sm", 2) // tiles))
    per = cdiv(kt, split)
    return {"BLOCK_M": bm, "STAGES": stages, "AHEAD": ahead, "PREFETCH": prefetch, "SPLIT": cdiv(kt, per),
            "kt_per_split": per}


@functools.lru_cache(maxsize=64)
def _x_layout(block_m: int, f16: bool):
    return gl.NVMMASharedLayout.get_default_for([block_m, TILE_K], gl.float16 if f16 else gl.bfloat16)


def gluon_rows(x: torch.Tensor, w: PackedNVFP4, what: str) -> tuple:
    """A Gluon packed GEMM's checks and operands: (lead dims, x as rows [M, K] that TMA can read,
    the output [M, N]), or the error naming what is wrong (`what`: the caller's name)."""
    if not isinstance(w, PackedNVFP4):
        raise TypeError(f"{what}: w must be a PackedNVFP4 (kernels.packed_gemm.pack), got {type(w).__name__}")
    n, k = w.shape
    check_activations(x, k, what)
    if x.dtype != w.dtype:
        raise ValueError(f"{what}: activations are {x.dtype} but the weight was packed for {w.dtype}")
    if x.device.type != "cuda" or w.words.device != x.device:
        raise RuntimeError(f"{what}: runs on one CUDA device (Gluon, sm_90), got x on {x.device} and the "
                           f"weight on {w.words.device}; packed_gemm.packed_matmul runs anywhere")
    if torch.cuda.get_device_capability(x.device) != (9, 0):
        raise RuntimeError(f"{what}: the kernel is written for sm_90 (wgmma, TMA), got "
                           f"sm_{''.join(map(str, torch.cuda.get_device_capability(x.device)))}")
    lead, x2, out = activation_rows(x, k, n)
    if x2.shape[0] and not tma_ready(x2):
        x2 = x2.clone(memory_format=torch.contiguous_format)
        if not tma_ready(x2):
            raise FormatError(f"{what}: the activations' rows must be 16-byte multiples for TMA, got K={k}")
    return lead, x2, out


def x_descriptor(x2: torch.Tensor, block_m: int) -> TensorDescriptor:
    """The activations' TMA descriptor, blocks [block_m, 128] in the wgmma B operand's layout."""
    return TensorDescriptor.from_tensor(x2, [block_m, TILE_K], _x_layout(block_m, x2.dtype == torch.float16))


def split_partials(out: torch.Tensor, split: int, grid: tuple) -> tuple:
    """(fp32 partials [split, M, N], tile counters) for a launch that splits K `split` ways over a
    grid (tiles along N, tiles along M, split), as `tiles.store_split` takes them; `out` for both
    where nothing is split (neither is read)."""
    if split == 1:
        return out, out
    return (torch.empty((split, *out.shape), dtype=torch.float32, device=out.device),
            split_counters(out.device, grid[0] * grid[1]))


def packed_matmul_overlapped(x: torch.Tensor, w: PackedNVFP4, *, cfg: dict | None = None) -> torch.Tensor:
    """y = x @ W.unpack().dequantize(x.dtype)^T on an sm_90 GPU, fp32 accumulation, output in x's
    dtype: `packed_gemm.packed_matmul`'s result, with the K tiles overlapped (module docstring).

    x: [..., K] bf16 / fp16 (the dtype `w` was packed for), its rows 16-byte aligned (TMA);
    w: a `PackedNVFP4`. cfg: launch-shape overrides (`config`)."""
    lead, x2, out = gluon_rows(x, w, _WHAT)
    n, k = w.shape
    m = x2.shape[0]
    if m == 0:
        return out.reshape(*lead, n)
    c = config(m, n, k, x.device, cfg)
    n16, kt = w.words.shape[:2]
    grid = (cdiv(n16, WARPS), cdiv(m, c["BLOCK_M"]), c["SPLIT"])
    f16 = x.dtype == torch.float16
    desc = x_descriptor(x2, c["BLOCK_M"])
    part, counters = split_partials(out, c["SPLIT"], grid)
    _overlap_kernel[grid](desc, w.words, w.scales, w.global_scale, out, part, counters, m, n, n16, kt,
                          c["kt_per_split"], BLOCK_M=c["BLOCK_M"], SPLIT=c["SPLIT"], STAGES=c["STAGES"], F16=f16,
                          AHEAD=c["AHEAD"], PREFETCH=c["PREFETCH"], num_warps=WARPS, **launch_options())
    return out.reshape(*lead, n)

