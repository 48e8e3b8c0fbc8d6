"""W4A16 GEMM on a pre-packed NVFP4 weight for 1-64 bf16 activation rows, with K split over a
thread block cluster (CUDA C++ compiled at run time by NVRTC, sm_90a).

`packed_ws` decodes each K tile once per block of activation rows: at 17-64 rows on a GPU of 132
multiprocessors its one-wave rule runs 32-row blocks, so every weight is decoded twice, and a
program's K tiles cost the same instructions whatever its rows. Here a block takes all the rows
(the wgmma's N: M rounded up to 16), so each weight is decoded once, and the K tiles of a 64-row
slice of the weight are split over the CL blocks of a cluster and the WG warpgroups of each block
(4 warps, 16 weight rows per warp; part p = rank * WG + warpgroup takes the p-th contiguous share
of the K tiles, in order). Every warpgroup runs the same code:

- its activation tiles [BN, 128] come by cp.async into a ring of STAGES shared-memory buffers of
  its own, STAGES - 1 ahead (rows past M and columns past K filled with zeros), laid out in the
  wgmma's 128-byte swizzle (each row's 256 bytes copied by 16 lanes);
- a tile's codes and scales are loaded PF - 1 tiles ahead of their decoding, decoded in registers
  by `packed_gemm.decode_asm` (the bytes of `NVFP4Tensor.dequantize`, times 2^-7) and handed to
  wgmma as its A operand from registers, four 16-wide chunks at a time, the tile's eight wgmma
  waited for together;
- it puts its fp32 sums in its shared memory (rows padded so that a warp's stores hit distinct
  banks); the cluster meets at a barrier, and block r adds up its share of the outputs over the
  CL * WG parts, read through distributed shared memory, in the order of K, scales them by the
  global scale times 2^7 and stores them in bf16; a second barrier keeps each block's sums until
  the others have read them.

Every sum runs in a fixed order, so a launch shape always gives the same bytes (not those of
`packed_matmul` or `packed_ws`, whose splits of K differ). The source is built per launch shape
(`cuda_source`), compiled once per shape with NVRTC (torch's, from the nvidia-cuda-nvrtc package
that CUDA builds of torch depend on) and launched through the CUDA driver API (ctypes). On a CPU,
on a GPU other than sm_90, or for fp16 the launcher refuses. `packed_linear.packed_linear` hands
it 16-48 rows where its one wave fills the GPU (`packed_linear.cluster_rows`). Measured against
bf16, `packed_ws` and `packed_matmul`: benchmarks/README.md."""

from __future__ import annotations

import ctypes
import functools

import torch

from .backend import capability, cdiv, sm_count
from .packed_gemm import TILE_K, PackedNVFP4, decode_asm

_WHAT = "kernels.packed_matmul_cluster"
WARPS = 4  # one warpgroup per block: 64 weight rows, 16 per warp
LAUNCH_KEYS = ("CL", "WG", "STAGES", "PF")
MAX_CLUSTER = 8  # the portable cluster size
CLUSTERS = (1, 2, 4, 8)  # the default's choices (clusters of 3 measured slower: benchmarks/README.md)
# What a block costs besides its K tiles, in one warpgroup's K tiles (its start, the cluster's sums
# and the stores): fitted to launches of 1, 2 and 4 blocks per cluster (benchmarks/README.md).
BLOCK_TILES = 4
SMEM_BYTES = 232448  # an sm_90 block's shared memory at most (227 KiB)


def mma_rows(m: int) -> int:
    """The wgmma's N for m activation rows (1 to 64): m rounded up to a multiple of 16."""
    return 16 * cdiv(m, 16)


def smem_bytes(bn: int, stages: int, wg: int) -> int:
    """A block's dynamic shared memory: per warpgroup STAGES activation tiles [BN, 128] bf16 (its
    fp32 sums [BN, 68] take its first tiles' place after the K loop), and 1 KiB to align them."""
    return wg * stages * bn * TILE_K * 2 + 1024


def _asm(text: str) -> str:
    """PTX for a CUDA inline asm statement: Triton's $n operands as %n, each line quoted."""
    body = text.replace("$", "%")
    return "\n".join(f'        "{line}\\n"' for line in body.splitlines())


def cuda_source(bn: int, cl: int, wg: int, stages: int, pf: int, swizzle: bool = True, skip: tuple = ()) -> str:
    """The kernel `packed_cluster` for one launch shape: BN activation rows per block (the wgmma's
    N: 16, 32, 48 or 64), CL blocks per cluster, WG warpgroups per block (each its own share of
    K), STAGES activation buffers per warpgroup, codes and scales loaded PF - 1 tiles ahead (PF 2
    or 3). swizzle: the activation tiles in the wgmma's 128-byte swizzle (else its plain 8 x 8 core
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
#define STAGES {stages}
#define PF {pf}
#define STAGE_BYTES (BN * 256)
#define RING_BYTES (STAGES * STAGE_BYTES)
#define SWIZZLE {int(swizzle)}
#define AHEAD (STAGES - 1)
#define SP 68  // the sums' row stride in floats: a warp's stores in distinct banks
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

// K tile kt of the activations (rows row0.., zeros past M and K) into the buffer at dst. Swizzled:
// warp v copies rows 8 j + 2 v + lane / 16, each row's 256 bytes by 16 lanes, granule (16 bytes, 8
// values) g of row r at (g / 8) * BN * 128 + (r / 8) * 1024 + (r % 8) * 128 + ((g % 8) ^ (r % 8)) * 16;
// plain: warp v copies granules g = 4 v + lane / 8 of rows 8 j + lane % 8, at ((g * BN / 8 + r / 8) *
// 8 + r % 8) * 16.
static __device__ __forceinline__ void load_x(u32 dst, const unsigned short *x, int row0, int M, int K, int kt,
                                               int v, int lane) {{
#if !SKIP_X
#if SWIZZLE
    const int g = lane & 15, r = 2 * v + (lane >> 4);
    const u32 d0 = dst + (g >> 3) * (BN * 128) + r * 128 + (((g & 7) ^ r) * 16);
#else
    const int g = 4 * v + (lane >> 3), r = lane & 7;
    const u32 d0 = dst + ((g * (BN / 8)) * 8 + r) * 16;
#endif
    const int col = kt * 128 + g * 8;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {{
        const int row = row0 + 8 * j + r;
        const bool ok = row < M && col < K;
        cp16(d0 + j * (SWIZZLE ? 1024 : 128), ok ? x + (long long)row * K + col : x, ok ? 16u : 0u);
    }}
#endif
}}

extern "C" __global__ void __cluster_dims__(CL, 1, 1) __launch_bounds__(128 * WG, 1)
packed_cluster(const uint4 *__restrict__ words, const uint4 *__restrict__ scales, const float *__restrict__ gs,
               const unsigned short *__restrict__ x, unsigned short *__restrict__ out, int M, int N, int N16, int KT,
               int K) {{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // the swizzle's 1024-byte groups at 1024-byte aligned addresses (the launch adds 1 KiB)
    unsigned char *smem = smem_raw + ((1024 - ((u32)__cvta_generic_to_shared(smem_raw) & 1023)) & 1023);
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const u32 base = (u32)__cvta_generic_to_shared(smem) + wg * RING_BYTES;
    const u32 rank = cluster_rank();
    const int pid_n = blockIdx.x / CL;
    const int row0 = blockIdx.y * BN;
    const int part = (int)rank * WG + wg;  // the K tiles of part p: KT * p / (CL * WG) on, in order
    const int kt0 = (int)(((long long)part * KT) / (CL * WG));
    const int n_k = (int)(((long long)(part + 1) * KT) / (CL * WG)) - kt0;
    const int slab = min(pid_n * 4 + warp, N16 - 1);
    const uint4 *wp = words + ((long long)slab * KT * 32 + lane) * 2;
    const uint4 *sp = scales + ((long long)slab * KT * 8 + (lane >> 2)) * 2;
    const int last = KT - 1;

#pragma unroll
    for (int s = 0; s < AHEAD; ++s) {{
        if (s < n_k) load_x(base + s * STAGE_BYTES, x, row0, M, K, kt0 + s, warp, lane);
        asm volatile("cp.async.commit_group;\\n" ::: "memory");
    }}
    uint4 rw[PF][2], rs[PF][2];
#pragma unroll
    for (int s = 0; s < PF - 1; ++s) {{
        int kt = min(kt0 + s, last);
        rw[s][0] = wp[kt * 64]; rw[s][1] = wp[kt * 64 + 1];
        rs[s][0] = sp[kt * 16]; rs[s][1] = sp[kt * 16 + 1];
    }}
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;

    for (int i0 = 0; i0 < n_k; i0 += PF) {{
#pragma unroll
        for (int j = 0; j < PF; ++j) {{
            const int i = i0 + j;
            if (i < n_k) {{
                {{  // codes and scales PF - 1 tiles on, into the slot tile i - 1 had
                    const int nj = (j + PF - 1) % PF;
                    int kt = min(kt0 + i + PF - 1, last);
                    rw[nj][0] = wp[kt * 64]; rw[nj][1] = wp[kt * 64 + 1];
                    rs[nj][0] = sp[kt * 16]; rs[nj][1] = sp[kt * 16 + 1];
                }}
                asm volatile("cp.async.wait_group %0;\\n" :: "n"(AHEAD - 1) : "memory");
                asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory");
                asm volatile("bar.sync %0, 128;\\n" :: "r"(1 + wg) : "memory");
                {{
                    const int nxt = i + AHEAD;
                    if (nxt < n_k) load_x(base + (nxt % STAGES) * STAGE_BYTES, x, row0, M, K, kt0 + nxt, warp, lane);
                    asm volatile("cp.async.commit_group;\\n" ::: "memory");
                }}
                const u32 xb = base + (i % STAGES) * STAGE_BYTES;
                u32 a[8][4];
#pragma unroll
                for (int G = 0; G < 2; ++G) {{
                    const uint4 w = rw[j][G], sc = rs[j][G];
                    const u32 ww[4] = {{w.x, w.y, w.z, w.w}};
                    const u32 s01[2] = {{__byte_perm(sc.x, sc.y, 0x5410), __byte_perm(sc.z, sc.w, 0x5410)}};
                    const u32 s23[2] = {{__byte_perm(sc.x, sc.y, 0x7632), __byte_perm(sc.z, sc.w, 0x7632)}};
#pragma unroll
                    for (int q = 0; q < 4; ++q)
                        decode(ww[q], s01[q & 1], s23[q & 1], a[4 * G][q], a[4 * G + 1][q], a[4 * G + 2][q],
                               a[4 * G + 3][q]);
#if SKIP_MMA
                    u32 f = 0;
#pragma unroll
                    for (int t = 0; t < 16; ++t) f ^= a[4 * G + t / 4][t % 4];
                    d[0] += (float)(f & 1);
#else
                    asm volatile("wgmma.fence.sync.aligned;\\n" ::: "memory");
#pragma unroll
                    for (int t = 0; t < 4; ++t) mma(d, a[4 * G + t], descriptor(xb, 4 * G + t));
#endif
                }}
                asm volatile("wgmma.commit_group.sync.aligned;\\n" ::: "memory");
                asm volatile("wgmma.wait_group.sync.aligned 0;\\n" ::: "memory");
                keep(d);
            }}
        }}
    }}
    asm volatile("cp.async.wait_group 0;\\n" ::: "memory");
    asm volatile("bar.sync %0, 128;\\n" :: "r"(1 + wg) : "memory");
    float *sums = (float *)(smem + wg * RING_BYTES);  // [BN][SP]: activation row by weight row
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {{
        int row = 16 * warp + (lane >> 2) + 8 * ((i >> 1) & 1);
        int col = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
        sums[col * SP + row] = d[i];
    }}
    asm volatile("barrier.cluster.arrive.release.aligned;\\nbarrier.cluster.wait.acquire.aligned;\\n" ::: "memory");
    // Block `rank` sums the outputs e4 = 4 e .. 4 e + 3 (activation row e / 16, weight rows 4 (e % 16)..)
    // of its share over the CL * WG parts in the order of K, scales them and stores them.
    const float scale = gs[0] * 128.0f;
    const u32 sums0 = (u32)__cvta_generic_to_shared(smem);
    const int e_end = (int)(((rank + 1) * (16 * BN)) / CL);
    for (int e = (int)((rank * (16 * BN)) / CL) + tid; e < e_end; e += 128 * WG) {{
        float4 v[CL * WG];
#pragma unroll
        for (int q = 0; q < CL * WG; ++q) v[q] = remote_load4(sums0 + (q % WG) * RING_BYTES + (e >> 4) * (SP * 4) + (e & 15) * 16,
                                                                        q / WG);
        float4 t = v[0];
#pragma unroll
        for (int q = 1; q < CL * WG; ++q) {{ t.x += v[q].x; t.y += v[q].y; t.z += v[q].z; t.w += v[q].w; }}
        const int m = row0 + (e >> 4), n = pid_n * 64 + 4 * (e & 15);
        if (m < M) {{
            u32 lo, hi;
            asm("cvt.rn.bf16x2.f32 %0, %1, %2;\\n" : "=r"(lo) : "f"(t.y * scale), "f"(t.x * scale));
            asm("cvt.rn.bf16x2.f32 %0, %1, %2;\\n" : "=r"(hi) : "f"(t.w * scale), "f"(t.z * scale));
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
    """Launch shape for an [m, k] @ [n, k]^T problem (m 1 to 64): CL (blocks per cluster), WG
    (warpgroups per block, 1, 2 or 4; default 4), STAGES (activation buffers per warpgroup, default
    3) and PF (codes loaded PF - 1 tiles ahead, default 2), overridden by cfg. K is split into
    CL * WG parts. Default CL, for a GPU of `sms` multiprocessors: the one of CLUSTERS whose busiest
    multiprocessor takes least, its N / 64 * CL blocks spread evenly in waves of one block each, a
    block costing its warpgroups' K tiles plus BLOCK_TILES (ties: the smaller CL); without `sms`, 2."""
    c = dict(cfg or {})
    unknown = set(c) - set(LAUNCH_KEYS)
    if unknown:
        raise ValueError(f"{_WHAT}: unknown launch keys {sorted(unknown)}; expected some of {LAUNCH_KEYS}")
    if not 1 <= m <= 64:
        raise ValueError(f"{_WHAT}: takes 1 to 64 activation rows, got {m}")
    kt = cdiv(k, TILE_K)
    tiles_n = cdiv(n, 16 * WARPS)
    wg = c.get("WG", 4)
    if "CL" in c:
        cl = c["CL"]
    elif sms is None:
        cl = 2
    else:
        cl = min(CLUSTERS, key=lambda q: (cdiv(tiles_n * q, sms) * (cdiv(kt, q * wg) + BLOCK_TILES), q))
    stages, pf = c.get("STAGES", 3), c.get("PF", 2)
    bn = mma_rows(m)
    if not 1 <= cl <= MAX_CLUSTER or wg not in (1, 2, 4) or not 2 <= stages <= 8 or pf not in (2, 3):
        raise ValueError(f"{_WHAT}: CL must be 1 to {MAX_CLUSTER}, WG 1, 2 or 4, STAGES 2 to 8 and PF 2 or 3, got "
                         f"{cl}, {wg}, {stages}, {pf}")
    if smem_bytes(bn, stages, wg) > SMEM_BYTES:
        raise ValueError(f"{_WHAT}: {wg} warpgroups of {stages} stages of {bn} rows need "
                         f"{smem_bytes(bn, stages, wg)} bytes of shared memory, more than a block has ({SMEM_BYTES})")
    return {"BN": bn, "CL": cl, "WG": wg, "STAGES": stages, "PF": pf}


@functools.lru_cache(maxsize=4096)
def _default_config(m: int, n: int, k: int, sms: int) -> dict:
    """`config` without overrides, kept per problem shape (the caller must not change it)."""
    return config(m, n, k, None, sms)


def launch_grid(m: int, n: int, c: dict) -> tuple:
    """The grid of a launch of `config` c: (N / 64 * CL, 1) blocks, clusters of CL along x."""
    return cdiv(n, 16 * WARPS) * c["CL"], cdiv(m, c["BN"])


class _Kernel:
    """One compiled launch shape: its CUDA module and function, launched through the driver API."""

    def __init__(self, cubin: bytes, smem: int, threads: int) -> None:
        cuda = _driver()
        self.module, self.func = ctypes.c_void_p(), ctypes.c_void_p()
        _check(cuda.cuModuleLoadData(ctypes.byref(self.module), cubin), "cuModuleLoadData")
        _check(cuda.cuModuleGetFunction(ctypes.byref(self.func), self.module, b"packed_cluster"), "cuModuleGetFunction")
        _check(cuda.cuFuncSetAttribute(self.func, 8, smem), "cuFuncSetAttribute")  # max dynamic shared memory
        self.smem, self.threads = smem, threads

    def __call__(self, grid: tuple, ptrs: tuple, ints: tuple, stream: int) -> None:
        vals = [ctypes.c_void_p(p) for p in ptrs] + [ctypes.c_int(i) for i in ints]
        args = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
        _check(_driver().cuLaunchKernel(self.func, grid[0], grid[1], 1, self.threads, 1, 1, self.smem, ctypes.c_void_p(stream),
                                        args, None), "cuLaunchKernel")


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
             skip: tuple = ()):
    """The kernel of one launch shape, compiled by NVRTC for sm_90a and loaded on the device, its
    dynamic shared memory limit raised to what the shape takes."""
    cubin = compile_cubin(cuda_source(bn, cl, wg, stages, pf, swizzle, skip))
    with torch.cuda.device(device_index):
        torch.cuda.current_stream(device_index)  # the device's context current
        return _Kernel(cubin, smem_bytes(bn, stages, wg), 128 * wg)


def packed_matmul_cluster(x: torch.Tensor, w: PackedNVFP4, *, cfg: dict | None = None,
                          swizzle: bool = True, skip: tuple = ()) -> torch.Tensor:
    """y = x @ W.unpack().dequantize(x.dtype)^T for 1 to 64 rows of bf16 x on an sm_90 GPU, fp32
    accumulation, bf16 output, K split over a cluster's blocks (module docstring); cfg: launch-shape
    overrides (`config`)."""
    if x.device.type != "cuda" or capability(x.device) != (9, 0):
        raise RuntimeError(f"{_WHAT}: runs on an sm_90 GPU, got {x.device}")
    if not isinstance(w, PackedNVFP4):
        raise TypeError(f"{_WHAT}: the weight must be a PackedNVFP4, got {type(w).__name__}")
    if not (w.words.is_contiguous() and w.scales.is_contiguous()) or w.words.device != x.device:
        raise ValueError(f"{_WHAT}: the packed weight must be contiguous and on {x.device}")
    if x.dtype != torch.bfloat16 or w.scales.dtype != torch.bfloat16:
        raise ValueError(f"{_WHAT}: takes bf16 activations and a weight packed for bf16, got {x.dtype} and "
                         f"{w.scales.dtype}")
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"{_WHAT}: x has {x.shape[-1]} columns, the weight {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    sms = sm_count(x.device)
    c = _default_config(m, n, k, sms) if cfg is None else config(m, n, k, cfg, sms)
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    kernel = compiled(c["BN"], c["CL"], c["WG"], c["STAGES"], c["PF"], index, swizzle, tuple(skip))
    n16, kt = w.words.shape[:2]
    gx, gy = launch_grid(m, n, c)
    kernel((gx, gy), (w.words.data_ptr(), w.scales.data_ptr(), w.global_scale.data_ptr(), x2.data_ptr(),
                      out.data_ptr()), (m, n, n16, kt, k), torch.cuda.current_stream(x.device).cuda_stream)
    return out.reshape(*lead, n)
