"""W4A16 GEMM on a pre-packed NVFP4 weight for 1-64 bf16 activation rows, with K split over a
thread block cluster (CUDA C++ compiled at run time by NVRTC, sm_90a).

`packed_ws` decodes each K tile once per block of activation rows: at 17-64 rows on a GPU of 132
multiprocessors its one-wave rule runs 32-row blocks, so every weight is decoded twice, and a
program's K tiles cost the same instructions whatever its rows. Here a block takes all the rows
(the wgmma's N: M rounded up to 8), so each weight is decoded once. A block holds WN slices of 64
weight rows, and the K tiles of those are split over the CL blocks of a cluster and WG shares of
each block (part p = rank * WG + share takes the p-th contiguous share of the K tiles, in order);
each (share, slice) is one warpgroup (4 warps, 16 weight rows per warp). Every warpgroup runs the
same code:

- its share's activation tiles [BN, 128] come by cp.async into a ring of STAGES shared-memory
  buffers, copied by the share's WN warpgroups together and read by all of them, STAGES - 1 ahead
  (rows past M and columns past K filled with zeros), laid out in the wgmma's 128-byte swizzle
  (each row's 256 bytes copied by 16 lanes);
- a tile's codes and scales are loaded PF - 1 tiles ahead of their decoding, decoded in registers
  by `packed_gemm.decode_asm` (the bytes of `NVFP4Tensor.dequantize`, times 2^-7) and handed to
  wgmma as its A operand from registers, four 16-wide chunks at a time, the tile's eight wgmma
  waited for together (DB 1: waited for after the next tile is decoded, from a second set of
  registers, the activations then STAGES - 2 tiles ahead);
- it puts its fp32 sums in shared memory (rows padded so that a warp's stores hit distinct banks);
  the cluster meets at a barrier, and block r adds up its share of the outputs over the CL * WG
  parts, read through distributed shared memory, in the order of K, scales them by the global
  scale times 2^7 and stores them in bf16; a second barrier keeps each block's sums until the
  others have read them.

By default (PDL 1) a launch is a programmatic dependent of the kernel before it on the stream: it
may start while that kernel finishes, loads its first codes and scales, and waits for it
(`griddepcontrol.wait`) before it copies an activation or stores an output; once its K loop is
done it lets the kernel after it start likewise.

Every sum runs in a fixed order, the same for any WN and DB, so a launch shape's CL and WG give
the same bytes call after call (not those of `packed_matmul` or `packed_ws`, whose splits of K
differ). The source is built per launch shape (`cuda_source`), compiled once per shape with NVRTC
(torch's, from the nvidia-cuda-nvrtc package that CUDA builds of torch depend on) and launched
through the CUDA driver API (ctypes). On a CPU, on a GPU other than sm_90, or for fp16 the launcher
refuses. `packed_linear.packed_linear` hands it 16-64 rows where its one wave fills the GPU
(`packed_linear.cluster_rows`). Measured against bf16, `packed_ws` and `packed_matmul`:
benchmarks/README.md."""

from __future__ import annotations

import ctypes
import functools
import struct
import threading

import torch

from .backend import capability, cdiv, current_stream, sm_count
from .packed_gemm import SLAB, TILE_K, PackedNVFP4, decode_asm

_WHAT = "kernels.packed_matmul_cluster"
WARPS = 4  # one warpgroup per block: 64 weight rows, 16 per warp
LAUNCH_KEYS = ("BN", "CL", "WG", "WN", "STAGES", "PF", "DB", "PDL")
MAX_CLUSTER = 8  # the portable cluster size
CLUSTERS = (1, 2, 4, 8)  # the default's choices (clusters of 3 measured slower: benchmarks/README.md)
# What a block costs besides its K tiles, in one warpgroup's K tiles (its start, the cluster's sums
# and the stores): fitted to launches of 1, 2 and 4 blocks per cluster (benchmarks/README.md).
BLOCK_TILES = 4
WG4_ROWS = 32  # up to these rows four shares of K per block by default, above them two (benchmarks/README.md)
SMEM_BYTES = 232448  # an sm_90 block's shared memory at most (227 KiB)


def mma_rows(m: int) -> int:
    """The wgmma's N for m activation rows (1 to 64): m rounded up to a multiple of 8."""
    return 8 * cdiv(m, 8)


def default_shares(m: int) -> int:
    """`config`'s default WG (shares of K per block) at m activation rows: 4 up to WG4_ROWS, else 2."""
    return 4 if m <= WG4_ROWS else 2


def smem_bytes(bn: int, stages: int, wg: int, wn: int = 1) -> int:
    """A block's dynamic shared memory: per share of K, STAGES activation tiles [BN, 128] bf16, or
    where more, per warpgroup its fp32 sums [BN, 68], which take the tiles' place after the K loop;
    and 1 KiB to align them."""
    return max(wg * stages * bn * TILE_K * 2, wg * wn * bn * 68 * 4) + 1024


def _asm(text: str) -> str:
    """PTX for a CUDA inline asm statement: Triton's $n operands as %n, each line quoted."""
    body = text.replace("$", "%")
    return "\n".join(f'        "{line}\\n"' for line in body.splitlines())


# One K tile of a warpgroup (tile i of its part, codes in slot @J@ of PF, A fragments in @A@): its
# codes and scales PF - 1 tiles on loaded, its activations waited for and those STAGES - 1 - DB tiles
# on started, its codes decoded and its wgmma issued, then the wgmma of all tiles but the last DB
# waited for. C++ text for `cuda_source`, @J@ and @A@ put in by `_tiles`.
_TILE = """        {  // codes and scales PF - 1 tiles on, into the slot tile i - 1 had
            const int nj = (@J@ + PF - 1) % PF;
            int kt = min(kt0 + i + PF - 1, last);
            rw[nj][0] = wp[kt * 64]; rw[nj][1] = wp[kt * 64 + 1];
            rs[nj][0] = sp[kt * 16]; rs[nj][1] = sp[kt * 16 + 1];
        }
        asm volatile("cp.async.wait_group %0;\\n" :: "n"(AHEAD - 1) : "memory");
        asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory");
        asm volatile("bar.sync %0, %1;\\n" :: "r"(1 + wg), "n"(GROUP) : "memory");
        {
            const int nxt = i + AHEAD;
            if (nxt < n_k) load_x(base + (nxt % STAGES) * STAGE_BYTES, x, row0, M, K, kt0 + nxt, t);
            asm volatile("cp.async.commit_group;\\n" ::: "memory");
        }
        const u32 xb = base + (i % STAGES) * STAGE_BYTES;
        u32 (&frag)[8][4] = @A@;
#pragma unroll
        for (int G = 0; G < 2; ++G) {
            const uint4 w = rw[@J@][G], sc = rs[@J@][G];
            const u32 ww[4] = {w.x, w.y, w.z, w.w};
            const u32 s01[2] = {__byte_perm(sc.x, sc.y, 0x5410), __byte_perm(sc.z, sc.w, 0x5410)};
            const u32 s23[2] = {__byte_perm(sc.x, sc.y, 0x7632), __byte_perm(sc.z, sc.w, 0x7632)};
#pragma unroll
            for (int q = 0; q < 4; ++q)
                decode(ww[q], s01[q & 1], s23[q & 1], frag[4 * G][q], frag[4 * G + 1][q], frag[4 * G + 2][q],
                       frag[4 * G + 3][q]);
#if SKIP_MMA
            u32 f = 0;
#pragma unroll
            for (int u = 0; u < 16; ++u) f ^= frag[4 * G + u / 4][u % 4];
            d[0] += (float)(f & 1);
#else
            asm volatile("wgmma.fence.sync.aligned;\\n" ::: "memory");
#pragma unroll
            for (int u = 0; u < 4; ++u) mma(d, frag[4 * G + u], descriptor(xb, 4 * G + u));
#endif
        }
        asm volatile("wgmma.commit_group.sync.aligned;\\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned %0;\\n" :: "n"(DB) : "memory");
"""


def _tiles(pf: int, db: int) -> str:
    """The K loop of `cuda_source`. DB 0: PF tiles a turn (each tile's slot of codes a constant), each
    tile's wgmma waited for before the next tile. DB 1 (PF 2): two tiles a turn, each with its own
    A fragments, so that a tile's wgmma runs while the next tile is decoded, the odd last tile after
    the loop."""

    def tile(i: str, j: str, frag: str) -> str:
        return f"        {{\n        const int i = {i};\n" + _TILE.replace("@J@", j).replace("@A@", frag) + "        }\n"

    if not db:  # j: a constant once unrolled
        return ("    for (int i0 = 0; i0 < n_k; i0 += PF) {\n#pragma unroll\n    for (int j = 0; j < PF; ++j) {\n"
                "    if (i0 + j < n_k) {\n        u32 a[8][4];\n" + tile("i0 + j", "j", "a") + "        keep(d);\n    }\n    }\n    }\n")
    return ("    u32 fa[2][8][4];\n    int i0 = 0;\n    for (; i0 + 1 < n_k; i0 += 2) {\n" + tile("i0", "0", "fa[0]")
            + tile("i0 + 1", "1", "fa[1]") + "    }\n    if (i0 < n_k) {\n" + tile("i0", "0", "fa[0]") + "    }\n"
            + '    asm volatile("wgmma.wait_group.sync.aligned 0;\\n" ::: "memory");\n    keep(d);\n')


def cuda_source(bn: int, cl: int, wg: int, stages: int, pf: int, swizzle: bool = True, skip: tuple = (),
                wn: int = 1, db: int = 0, pdl: int = 0) -> str:
    """The kernel `packed_cluster` for one launch shape: BN activation rows per block (the wgmma's
    N: a multiple of 8 up to 64), CL blocks per cluster, WG shares of K per block, WN slices of 64 weight
    rows per block (WG * WN warpgroups; the WN warpgroups of a share read the same activation
    buffers), STAGES activation buffers per share, codes and scales loaded PF - 1 tiles ahead (PF 2
    or 3), DB 1: each tile's wgmma left running while the next is decoded (two sets of A fragments,
    activations STAGES - 2 tiles ahead; else STAGES - 1), PDL 1: launched as a programmatic dependent
    of the kernel before it (its first codes and scales loaded, then a wait for that kernel before
    the activations are read; its dependents let start once its K loop is done). swizzle: the activation tiles in the wgmma's 128-byte swizzle (else its plain 8 x 8 core
    matrices). skip: stages left out, for timing the others ("x": the activation copies, "mma": the
    wgmma, the decoded fragments only folded into one accumulator); the product is then wrong."""
    acc_regs = bn // 2
    outs = ", ".join(f"%{i}" for i in range(acc_regs))
    a0 = acc_regs
    mma_asm = (f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.bf16.bf16 {{{outs}}}, "
               f"{{%{a0}, %{a0 + 1}, %{a0 + 2}, %{a0 + 3}}}, %{a0 + 4}, p, 1, 1, 0;")
    acc_ops = ", ".join(f'"+f"(d[{i}])' for i in range(acc_regs))
    unknown = set(skip) - {"x", "mma"}
    if unknown:
        raise ValueError(f"{_WHAT}: unknown stages to skip {sorted(unknown)}")
    return f"""
typedef unsigned int u32;
typedef unsigned long long u64;
#define BN {bn}
#define CL {cl}
#define WG {wg}
#define WN {wn}
#define STAGES {stages}
#define PF {pf}
#define STAGE_BYTES (BN * 256)
#define RING_BYTES (STAGES * STAGE_BYTES)
#define SWIZZLE {int(swizzle)}
#define DB {db}
#define PDL {pdl}
#define AHEAD (STAGES - 1 - DB)
#define SP 68  // the sums' row stride in floats: a warp's stores in distinct banks
#define SUMS_BYTES (BN * SP * 4)
#define GROUP (128 * WN)  // the threads of a share of K
#define SKIP_X {int("x" in skip)}
#define SKIP_MMA {int("mma" in skip)}

static __device__ __forceinline__ void decode(u32 w, u32 s01, u32 s23, u32 &o0, u32 &o1, u32 &o2, u32 &o3) {{
    asm(
{_asm(decode_asm("bf16"))}
        : "=r"(o0), "=r"(o1), "=r"(o2), "=r"(o3) : "r"(w), "r"(s01), "r"(s23));
}}

static __device__ __forceinline__ void mma(float *d, const u32 *a, u64 desc) {{
    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, 1, 0;\\n{mma_asm}\\n}}\\n"
        : {acc_ops}
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}}

static __device__ __forceinline__ void keep(float *d) {{
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}}

// The wgmma descriptor of chunk c (K 16 c..16 c + 15) of the activation tile at xb: 128-byte swizzle,
// 8-row groups 1024 bytes apart, the tile's two 64-wide halves BN * 128 bytes apart, a chunk 32 bytes
// on within its half; or plain core matrices 128 bytes apart along N and BN * 16 along K.
static __device__ __forceinline__ u64 descriptor(u32 xb, int c) {{
#if SWIZZLE
    const u32 addr = xb + (c >> 2) * (BN * 128) + (c & 3) * 32;
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(1024 >> 4) << 32) | (1ull << 62);
#else
    const u32 addr = xb + c * 2 * (BN / 8) * 128;
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(((BN / 8) * 128) >> 4) << 16) | ((u64)(128 >> 4) << 32);
#endif
}}

static __device__ __forceinline__ void cp16(u32 dst, const void *src, u32 bytes) {{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n" :: "r"(dst), "l"(src), "r"(bytes) : "memory");
}}

static __device__ __forceinline__ u32 cluster_rank() {{
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\\n" : "=r"(r));
    return r;
}}

static __device__ __forceinline__ float4 remote_load4(u32 addr, u32 rank) {{
    u32 remote;
    float4 v;
    asm("mapa.shared::cluster.u32 %0, %1, %2;\\n" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("ld.shared::cluster.v4.f32 {{%0, %1, %2, %3}}, [%4];\\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(remote));
    return v;
}}

// K tile kt of the activations (rows row0.., zeros past M and K) into the buffer at dst, copied by the
// share's thread t (0 to GROUP - 1): 8-row group jj = t / 128 + WN j of the tile; swizzled: granule
// (16 bytes, 8 values) g = t % 16 of row r = t / 16 % 8 of the group (each row's 256 bytes by 16
// lanes), granule g of row 8 jj + r at (g / 8) * BN * 128 + jj * 1024 + r * 128 + ((g % 8) ^ r) * 16;
// plain: granule g = t / 8 % 16 of row r = t % 8, at ((g * BN / 8 + jj) * 8 + r) * 16.
static __device__ __forceinline__ void load_x(u32 dst, const unsigned short *x, int row0, int M, int K, int kt,
                                               int t) {{
#if !SKIP_X
    const int slot = t >> 7;
#if SWIZZLE
    const int g = t & 15, r = (t >> 4) & 7;
    const u32 d0 = dst + (g >> 3) * (BN * 128) + slot * 1024 + r * 128 + (((g & 7) ^ r) * 16);
#else
    const int g = (t >> 3) & 15, r = t & 7;
    const u32 d0 = dst + ((g * (BN / 8) + slot) * 8 + r) * 16;
#endif
    const int col = kt * 128 + g * 8;
#pragma unroll
    for (int j = 0; j < (BN / 8 + WN - 1) / WN; ++j) {{
        const int jj = slot + WN * j;
        if (BN / 8 % WN == 0 || jj < BN / 8) {{
            const int row = row0 + 8 * jj + r;
            const bool ok = row < M && col < K;
            cp16(d0 + j * WN * (SWIZZLE ? 1024 : 128), ok ? x + (long long)row * K + col : x, ok ? 16u : 0u);
        }}
    }}
#endif
}}

extern "C" __global__ void __cluster_dims__(CL, 1, 1) __launch_bounds__(128 * WG * WN, 1)
packed_cluster(const uint4 *__restrict__ words, const uint4 *__restrict__ scales, const float *__restrict__ gs,
               const unsigned short *__restrict__ x, unsigned short *__restrict__ out, int M, int N, int N16, int KT,
               int K) {{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // the swizzle's 1024-byte groups at 1024-byte aligned addresses (the launch adds 1 KiB)
    unsigned char *smem = smem_raw + ((1024 - ((u32)__cvta_generic_to_shared(smem_raw) & 1023)) & 1023);
    // warpgroup wi: share of K wg = wi / WN, slice of weight rows wn = wi % WN
    const int tid = threadIdx.x, wi = tid >> 7, wg = wi / WN, wn = wi % WN, warp = (tid >> 5) & 3, lane = tid & 31;
    const int t = tid - wg * GROUP;  // the thread's place in its share
    const u32 base = (u32)__cvta_generic_to_shared(smem) + wg * RING_BYTES;
    const u32 rank = cluster_rank();
    const int pid_n = blockIdx.x / CL;
    const int row0 = blockIdx.y * BN;
    const int part = (int)rank * WG + wg;  // the K tiles of part p: KT * p / (CL * WG) on, in order
    const int kt0 = (int)(((long long)part * KT) / (CL * WG));
    const int n_k = (int)(((long long)(part + 1) * KT) / (CL * WG)) - kt0;
    const int slab = min((pid_n * WN + wn) * 4 + warp, N16 - 1);
    const uint4 *wp = words + ((long long)slab * KT * 32 + lane) * 2;
    const uint4 *sp = scales + ((long long)slab * KT * 8 + (lane >> 2)) * 2;
    const int last = KT - 1;

    uint4 rw[PF][2], rs[PF][2];
#if PDL  // the weight's first codes and scales, then the wait for the kernel before, which may write x
#pragma unroll
    for (int s = 0; s < PF - 1; ++s) {{
        int kt = min(kt0 + s, last);
        rw[s][0] = wp[kt * 64]; rw[s][1] = wp[kt * 64 + 1];
        rs[s][0] = sp[kt * 16]; rs[s][1] = sp[kt * 16 + 1];
    }}
    asm volatile("griddepcontrol.wait;\\n" ::: "memory");
#endif
#pragma unroll
    for (int s = 0; s < AHEAD; ++s) {{
        if (s < n_k) load_x(base + s * STAGE_BYTES, x, row0, M, K, kt0 + s, t);
        asm volatile("cp.async.commit_group;\\n" ::: "memory");
    }}
#if !PDL
#pragma unroll
    for (int s = 0; s < PF - 1; ++s) {{
        int kt = min(kt0 + s, last);
        rw[s][0] = wp[kt * 64]; rw[s][1] = wp[kt * 64 + 1];
        rs[s][0] = sp[kt * 16]; rs[s][1] = sp[kt * 16 + 1];
    }}
#endif
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;

{_tiles(pf, db)}    asm volatile("cp.async.wait_group 0;\\n" ::: "memory");
#if PDL
    asm volatile("griddepcontrol.launch_dependents;\\n" ::: "memory");
#endif
    __syncthreads();  // every share done with its buffers, which the sums overwrite
    float *sums = (float *)(smem + wi * SUMS_BYTES);  // [BN][SP]: activation row by weight row
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {{
        int row = 16 * warp + (lane >> 2) + 8 * ((i >> 1) & 1);
        int col = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
        sums[col * SP + row] = d[i];
    }}
    asm volatile("barrier.cluster.arrive.release.aligned;\\nbarrier.cluster.wait.acquire.aligned;\\n" ::: "memory");
    // Block `rank` sums the outputs e4 = 4 e .. 4 e + 3 (activation row e / (16 WN), weight rows 4 (e %
    // 16).. of slice e / 16 % WN) of its share over the CL * WG parts in the order of K, scales them
    // and stores them.
    const float scale = gs[0] * 128.0f;
    const u32 sums0 = (u32)__cvta_generic_to_shared(smem);
    const int e_end = (int)(((rank + 1) * (16 * WN * BN)) / CL);
    for (int e = (int)((rank * (16 * WN * BN)) / CL) + tid; e < e_end; e += 128 * WG * WN) {{
        const int am = e / (16 * WN), sl = (e >> 4) % WN, c = e & 15;
        const u32 at = sums0 + sl * SUMS_BYTES + am * (SP * 4) + c * 16;
        float4 v[CL * WG];
#pragma unroll
        for (int q = 0; q < CL * WG; ++q) v[q] = remote_load4(at + (q % WG) * WN * SUMS_BYTES, q / WG);
        float4 f = v[0];
#pragma unroll
        for (int q = 1; q < CL * WG; ++q) {{ f.x += v[q].x; f.y += v[q].y; f.z += v[q].z; f.w += v[q].w; }}
        const int m = row0 + am, n = (pid_n * WN + sl) * 64 + 4 * c;
        if (m < M) {{
            u32 lo, hi;
            asm("cvt.rn.bf16x2.f32 %0, %1, %2;\\n" : "=r"(lo) : "f"(f.y * scale), "f"(f.x * scale));
            asm("cvt.rn.bf16x2.f32 %0, %1, %2;\\n" : "=r"(hi) : "f"(f.w * scale), "f"(f.z * scale));
            unsigned short *o = out + (long long)m * N + n;
            if (n + 3 < N && (((unsigned long long)o) & 7) == 0) {{
                *(uint2 *)o = make_uint2(lo, hi);
            }} else {{
                if (n < N) o[0] = (unsigned short)(lo & 0xFFFF);
                if (n + 1 < N) o[1] = (unsigned short)(lo >> 16);
                if (n + 2 < N) o[2] = (unsigned short)(hi & 0xFFFF);
                if (n + 3 < N) o[3] = (unsigned short)(hi >> 16);
            }}
        }}
    }}
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\\nbarrier.cluster.wait.aligned;\\n" ::: "memory");
}}
"""


def config(m: int, n: int, k: int, cfg: dict | None = None, sms: int | None = None) -> dict:
    """Launch shape for an [m, k] @ [n, k]^T problem (m 1 to 64), overridden by cfg: BN (activation
    rows per block, the wgmma's N: a multiple of 8, default `mma_rows`; fewer than m: M / BN blocks
    of rows), CL (blocks per cluster), WG (shares of K per block; default 4 up to WG4_ROWS rows,
    else 2), WN (slices of 64 weight rows per block, whose warpgroups read one share's activation
    tiles together; WG * WN warpgroups, at most 4; default 1), STAGES (activation buffers per share,
    default 3), PF (codes loaded PF - 1 tiles ahead, default 2), DB (1: each tile's wgmma left
    running while the next tile is decoded; default 1 where PF is 2 and STAGES at least 3, else 0)
    and PDL (1, the default: a programmatic dependent launch, `cuda_source`). K is split into CL *
    WG parts. CL by default: the one of CLUSTERS for which the busiest multiprocessor of a GPU of
    `sms` multiprocessors takes least, the N / (64 WN) * CL blocks spread evenly in waves of one
    block each, a block costing its warpgroups' K tiles plus BLOCK_TILES (ties: the smaller CL);
    without `sms`, 2. The defaults are measured in benchmarks/README.md."""
    c = dict(cfg or {})
    unknown = set(c) - set(LAUNCH_KEYS)
    if unknown:
        raise ValueError(f"{_WHAT}: unknown launch keys {sorted(unknown)}; expected some of {LAUNCH_KEYS}")
    if not 1 <= m <= 64:
        raise ValueError(f"{_WHAT}: takes 1 to 64 activation rows, got {m}")
    kt = cdiv(k, TILE_K)
    wg, wn = c.get("WG", default_shares(m)), c.get("WN", 1)
    if "CL" in c:
        cl = c["CL"]
    elif sms is None:
        cl = 2
    else:
        tiles_n = cdiv(n, 16 * WARPS * wn)
        cl = min(CLUSTERS, key=lambda q: (cdiv(tiles_n * q, sms) * (cdiv(kt, q * wg) + BLOCK_TILES), q))
    stages, pf = c.get("STAGES", 3), c.get("PF", 2)
    db = c.get("DB", int(pf == 2 and stages >= 3))
    bn = c.get("BN", mma_rows(m))
    if bn not in range(8, 65, 8):
        raise ValueError(f"{_WHAT}: BN (activation rows per block, the wgmma's N) must be a multiple of 8 from 8 to 64, "
                         f"got {bn}")
    if db not in (0, 1) or (db and (pf != 2 or stages < 3)):
        raise ValueError(f"{_WHAT}: DB must be 0 or 1, and 1 only with PF 2 and STAGES 3 or more, got DB {db}, "
                         f"PF {pf}, STAGES {stages}")
    if (not 1 <= cl <= MAX_CLUSTER or wg not in (1, 2, 4) or wn not in (1, 2, 3, 4) or wg * wn > 4
            or not 2 <= stages <= 8 or pf not in (2, 3)):
        raise ValueError(f"{_WHAT}: CL must be 1 to {MAX_CLUSTER}, WG 1, 2 or 4, WN 1 to 4 with WG * WN at most 4, "
                         f"STAGES 2 to 8 and PF 2 or 3, got {cl}, {wg}, {wn}, {stages}, {pf}")
    pdl = c.get("PDL", 1)
    if pdl not in (0, 1):
        raise ValueError(f"{_WHAT}: PDL must be 0 or 1, got {pdl}")
    if smem_bytes(bn, stages, wg, wn) > SMEM_BYTES:
        raise ValueError(f"{_WHAT}: {wg} shares of {stages} stages of {bn} rows need "
                         f"{smem_bytes(bn, stages, wg, wn)} bytes of shared memory, more than a block has ({SMEM_BYTES})")
    return {"BN": bn, "CL": cl, "WG": wg, "WN": wn, "STAGES": stages, "PF": pf, "DB": db, "PDL": pdl}


@functools.lru_cache(maxsize=4096)
def _default_config(m: int, n: int, k: int, sms: int) -> dict:
    """`config` without overrides, kept per problem shape (the caller must not change it)."""
    return config(m, n, k, None, sms)


def launch_grid(m: int, n: int, c: dict) -> tuple:
    """The grid of a launch of `config` c: (N / (64 WN) * CL, 1) blocks, clusters of CL along x."""
    return cdiv(n, 16 * WARPS * c["WN"]) * c["CL"], cdiv(m, c["BN"])


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an attribute id, padding to 8 bytes, a 64-byte value."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig, for cuLaunchKernelEx."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _Kernel:
    """One compiled launch shape: its CUDA module and function, launched through the driver API; pdl:
    launched by cuLaunchKernelEx as a programmatic dependent of the kernel before it on the stream.
    Each thread keeps its own launch buffers (`_launch_buffers`), refilled on each call."""

    def __init__(self, cubin: bytes, smem: int, threads: int, pdl: bool = False) -> None:
        cuda = _driver()
        self.module, self.func = ctypes.c_void_p(), ctypes.c_void_p()
        _check(cuda.cuModuleLoadData(ctypes.byref(self.module), cubin), "cuModuleLoadData")
        _check(cuda.cuModuleGetFunction(ctypes.byref(self.func), self.module, b"packed_cluster"), "cuModuleGetFunction")
        _check(cuda.cuFuncSetAttribute(self.func, 8, smem), "cuFuncSetAttribute")  # max dynamic shared memory
        self.smem, self.threads, self.pdl = smem, threads, pdl
        self._local = threading.local()

    def __call__(self, grid: tuple, ptrs: tuple, ints: tuple, stream: int) -> None:
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = _launch_buffers(len(ptrs), len(ints), self.threads, self.smem, self.pdl)
        values, params, cfg = bufs
        values.fill(ptrs, ints)
        if cfg is not None:
            cfg.grid[0], cfg.grid[1] = grid
            cfg.stream = stream
            _check(_driver().cuLaunchKernelEx(ctypes.byref(cfg), self.func, params, None), "cuLaunchKernelEx")
            return
        _check(_driver().cuLaunchKernel(self.func, grid[0], grid[1], 1, self.threads, 1, 1, self.smem, ctypes.c_void_p(stream),
                                        params, None), "cuLaunchKernel")


class _ArgValues:
    """A kernel's parameter values in one buffer: n_ptrs 8-byte addresses, then n_ints 4-byte ints,
    written by one `struct` call (`fill`); `params` is the array of their addresses that
    cuLaunchKernel takes."""

    def __init__(self, n_ptrs: int, n_ints: int) -> None:
        self.layout = struct.Struct(f"={n_ptrs}Q{n_ints}i")
        self.buffer = ctypes.create_string_buffer(self.layout.size)
        base = ctypes.addressof(self.buffer)
        self.params = (ctypes.c_void_p * (n_ptrs + n_ints))(*[base + 8 * i for i in range(n_ptrs)],
                                                            *[base + 8 * n_ptrs + 4 * i for i in range(n_ints)])

    def fill(self, ptrs: tuple, ints: tuple) -> None:
        self.layout.pack_into(self.buffer, 0, *ptrs, *ints)


def _launch_buffers(n_ptrs: int, n_ints: int, threads: int, smem: int, pdl: bool) -> tuple:
    """(the parameter values, their address array, and for a programmatic dependent launch (pdl) its
    CUlaunchConfig of `threads` threads a block, else None)."""
    values = _ArgValues(n_ptrs, n_ints)
    cfg = None
    if pdl:
        attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        cfg = _LaunchConfig(smem=smem, attrs=ctypes.pointer(attr), num_attrs=1)
        cfg.block[0], cfg.block[1], cfg.block[2] = threads, 1, 1
        cfg.grid[2] = 1
    return values, values.params, cfg


@functools.cache
def _driver():
    return ctypes.CDLL("libcuda.so.1")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{_WHAT}: {what} failed with CUDA error {status}")


@functools.cache
def _nvrtc():
    """NVRTC as torch's CUDA build finds it (`torch.cuda._utils`; its name varies by release)."""
    from torch.cuda import _utils

    for name in ("_get_gpu_rtc_library", "_get_nvrtc_library"):
        if hasattr(_utils, name):
            return getattr(_utils, name)()
    raise RuntimeError(f"{_WHAT}: this torch ({torch.__version__}) offers no NVRTC")


def compile_cubin(source: str, arch: str = "sm_90a") -> bytes:
    """The cubin NVRTC makes of `source` for `arch`."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"packed_cluster.cu", 0, None, None),
           "nvrtcCreateProgram")
    opts = [f"--gpu-architecture={arch}".encode()]
    try:
        status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        if status != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"{_WHAT}: NVRTC failed:\n{log.value.decode()}")
        size = ctypes.c_size_t()
        _check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@functools.lru_cache(maxsize=64)
def compiled(bn: int, cl: int, wg: int, stages: int, pf: int, device_index: int, swizzle: bool = True,
             skip: tuple = (), wn: int = 1, db: int = 0, pdl: int = 0):
    """The kernel of one launch shape, compiled by NVRTC for sm_90a and loaded on the device, its
    dynamic shared memory limit raised to what the shape takes."""
    cubin = compile_cubin(cuda_source(bn, cl, wg, stages, pf, swizzle, skip, wn, db, pdl))
    with torch.cuda.device(device_index):
        torch.cuda.current_stream(device_index)  # the device's context current
        return _Kernel(cubin, smem_bytes(bn, stages, wg, wn), 128 * wg * wn, bool(pdl))


def packed_matmul_cluster(x: torch.Tensor, w: PackedNVFP4, *, cfg: dict | None = None,
                          swizzle: bool = True, skip: tuple = ()) -> torch.Tensor:
    """y = x @ W.unpack().dequantize(x.dtype)^T for 1 to 64 rows of bf16 x on an sm_90 GPU, fp32
    accumulation, bf16 output, K split over a cluster's blocks (module docstring); cfg: launch-shape
    overrides (`config`). The default launch's kernel, grid and sizes are kept per problem shape
    and GPU (`_default_launch`)."""
    device = x.device
    if device.type != "cuda" or capability(device) != (9, 0):
        raise RuntimeError(f"{_WHAT}: runs on an sm_90 GPU, got {device}")
    if not isinstance(w, PackedNVFP4):
        raise TypeError(f"{_WHAT}: the weight must be a PackedNVFP4, got {type(w).__name__}")
    words, scales = w.words, w.scales
    if not (words.is_contiguous() and scales.is_contiguous()) or words.device != device:
        raise ValueError(f"{_WHAT}: the packed weight must be contiguous and on {device}")
    if x.dtype != torch.bfloat16 or scales.dtype != torch.bfloat16:
        raise ValueError(f"{_WHAT}: takes bf16 activations and a weight packed for bf16, got {x.dtype} and "
                         f"{scales.dtype}")
    n, k = w.n, w.k
    if x.shape[-1] != k:
        raise ValueError(f"{_WHAT}: x has {x.shape[-1]} columns, the weight {k}")
    flat = x.dim() == 2
    x2 = x.contiguous() if flat else x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=torch.bfloat16, device=device)
    if m:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if cfg is None and swizzle and not skip:
            kernel, grid, sizes = _default_launch(m, n, k, index)
        else:
            kernel, grid, sizes = _launch(m, n, k, index, config(m, n, k, cfg, sm_count(device)), swizzle, tuple(skip))
        kernel(grid, (words.data_ptr(), scales.data_ptr(), w.global_scale.data_ptr(), x2.data_ptr(), out.data_ptr()),
               sizes, current_stream(index))
    return out if flat else out.reshape(*x.shape[:-1], n)


def _launch(m: int, n: int, k: int, index: int, c: dict, swizzle: bool = True, skip: tuple = ()) -> tuple:
    """(the compiled kernel, the grid, the kernel's size arguments) of launch shape c on GPU `index`."""
    kernel = compiled(c["BN"], c["CL"], c["WG"], c["STAGES"], c["PF"], index, swizzle, skip, c["WN"], c["DB"], c["PDL"])
    return kernel, launch_grid(m, n, c), (m, n, cdiv(n, SLAB), cdiv(k, TILE_K), k)


@functools.lru_cache(maxsize=4096)
def _default_launch(m: int, n: int, k: int, index: int) -> tuple:
    """`_launch` of the default launch shape, kept per problem shape and GPU."""
    return _launch(m, n, k, index, _default_config(m, n, k, sm_count(torch.device("cuda", index))))
