"""What a weight already in L2 buys the launches of a batch-1 decode step (GPU; a study).

A decode step at batch 1 is a chain of short launches, many far from the memory bandwidth:
while a Mamba step, a router or an attention launch runs, the memory sits mostly idle. Asking L2
for the next launch's weight then (`prefetch` below: one bulk prefetch per lane,
`cp.async.bulk.prefetch.L2.global`, sm_90; nothing waits for the bytes) would let that launch
read it from L2. This measures what that can buy. For each decode-step operation on the Nano
shapes (the FP8 Mamba projections through `torch._scaled_mm`, the W4A16 GEMV of a shared expert,
the BF16 attention projections) it times the operation's kernels (CUDA time from the profiler,
median over reps):

- cold: L2 flushed (a read of a buffer of four times its size) before the call;
- prefetched: L2 flushed, then `prefetch` of the weight (three launch shapes), a wait of `window`
  us on the GPU (`torch.cuda._sleep`), then the call;
- warm: the call right after the same call.

Then the prefetch launch itself on the in_proj weight, and the routed experts of one token (up
and down launches) cold, warm and with the chosen experts' weights prefetched. Writes
benchmarks/results/prefetch-<gpu>.json and prints a table.

    PYTHONPATH=.:scripts python scripts/bench_prefetch.py [--windows 0,3,6,12,25] [--reps 15]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from benchlib.record import run_record, write_results

from fp4kit.formats import nvfp4
from fp4kit.kernels.w4a16_gemm import w4a16_matmul

# (name, what, N, K)
SHAPES = (("mamba.in_proj", "fp8", 10304, 2688), ("mamba.out_proj", "fp8", 2688, 4096),
          ("shared_expert.up", "w4a16", 3712, 2688), ("shared_expert.down", "w4a16", 2688, 3712),
          ("attention.qkv", "bf16", 4608, 2688), ("attention.o_proj", "bf16", 2688, 4096))

# One lane's bulk prefetch: `size` bytes from `ptr` into L2 where size > 0 (16-byte multiples).
_BULK_ASM = tl.constexpr("""
{
.reg .pred p;
setp.gt.s32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}
""")

CHUNK = 4096  # bytes per lane and prefetch instruction


@triton.jit
def prefetch_bulk(ptr, size):
    """Asks L2 for `size` bytes from each `ptr` (16-byte aligned; size a multiple of 16) where
    size > 0, and goes on (no register receives anything). Returns a dummy 0 per element."""
    return tl.inline_asm_elementwise(_BULK_ASM, "=r,l,r", [ptr, size.to(tl.int32)], dtype=tl.int32, is_pure=False,
                                     pack=1)


@triton.jit
def prefetch_range(ptr, nbytes, part, parts, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Part `part` of `parts` asks L2 for its share of bytes [0, nbytes) from `ptr` (a uint8
    pointer, 16-byte aligned; nbytes a multiple of 16): LANES chunks of CHUNK bytes per round,
    the rounds of all parts interleaved so that the range is covered in address order."""
    lanes = tl.arange(0, LANES).to(tl.int64)
    span = parts.to(tl.int64) * (LANES * CHUNK)
    for start in range(part.to(tl.int64) * (LANES * CHUNK), nbytes, span):
        offs = start + lanes * CHUNK
        prefetch_bulk(ptr + offs, tl.minimum(nbytes - offs, CHUNK))


@triton.jit
def _prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    prefetch_range(ptr, nbytes, tl.program_id(0), tl.num_programs(0), CHUNK, LANES)


def supported(t: torch.Tensor) -> bool:
    """Whether `prefetch` asks anything for `t`: a CUDA tensor on sm_90 or later, compiled kernels,
    its first byte 16-byte aligned."""
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1" or t.data_ptr() % 16:
        return False
    return torch.cuda.get_device_capability(t.device) >= (9, 0)


def span_bytes(t: torch.Tensor) -> int:
    """The bytes from t's first element to its last, rounded down to 16 (what a prefetch covers)."""
    if t.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size() // 16 * 16


def prefetch(t: torch.Tensor, programs: int = 64, num_warps: int = 1, chunk: int = CHUNK) -> None:
    """One launch that asks L2 for `t`'s bytes on the current stream, returning before they arrive.
    Does nothing where `supported(t)` is false."""
    if not supported(t):
        return
    nbytes = span_bytes(t)
    if nbytes == 0:
        return
    lanes = 32 * num_warps
    programs = max(1, min(programs, triton.cdiv(nbytes, lanes * chunk)))
    _prefetch_kernel[(programs,)](_bytes(t, nbytes), nbytes, CHUNK=chunk, LANES=lanes, num_warps=num_warps)


def _bytes(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over `nbytes` bytes from t's first element."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), t.storage_offset() * t.element_size(),
                                                                    (nbytes,), (1,))


# The prefetch launches timed: (name, `prefetch` keywords)
VARIANTS = (("bulk4k_64p", dict(programs=64)), ("bulk4k_132p", dict(programs=132)),
            ("bulk16k_32p", dict(programs=32, chunk=16384)))


def operation(what: str, n: int, k: int, device: torch.device):
    """(call, weight tensors) of one decode-step operation at one row."""
    g = torch.Generator(device="cpu").manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device)
    x = torch.randn(1, k, generator=g).to(device, torch.bfloat16)
    if what == "fp8":
        scale = w.abs().amax() / 448
        wq = (w / scale).to(torch.float8_e4m3fn)
        xq = x.float().clamp(-448, 448).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        return (lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=scale.float(), out_dtype=torch.bfloat16)), [wq]
    if what == "w4a16":
        q = nvfp4.quantize(w)
        return (lambda: w4a16_matmul(x, q, backend="triton")), [q.packed, q.block_scale]
    wb = w.to(torch.bfloat16)
    return (lambda: F.linear(x, wb)), [wb]


def kernel_us(prof) -> float:
    """CUDA time of every kernel in one profiled call (the flush, wait and prefetch launches run
    before the profile starts)."""
    total = 0.0
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.self_device_time_total:
            total += e.self_device_time_total
    return total


def timed(call, before, reps: int) -> float:
    """Median over reps of the operation's kernel time, each rep `before()` then `call()`."""
    from torch.profiler import ProfilerActivity, profile

    out = []
    for _ in range(reps):
        before()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        out.append(kernel_us(prof))
    return statistics.median(out)


def sleep_rate() -> float:
    """GPU clock cycles per microsecond of `torch.cuda._sleep`, measured with events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return 10_000_000 / (start.elapsed_time(end) * 1e3)


def moe_launches(prof) -> list[float]:
    """CUDA times of the routed experts' launches in one profiled call, in launch order."""
    ev = [e for e in prof.events() if e.device_type.name == "CUDA" and "_moe_small_kernel" in e.name]
    return [e.device_time_total for e in sorted(ev, key=lambda e: e.time_range.start)]


def moe_rows(flush, cycles_per_us: float, reps: int, device: torch.device) -> dict:
    """The routed experts of one token (Nano: 128 experts of 1856 x 2688, top 6): the up and
    down launches' times cold, warm, with every chosen expert's weights prefetched before the up
    launch, and with only the down weights prefetched just before the up launch."""
    from torch.profiler import ProfilerActivity, profile

    from fp4kit.kernels.moe_gemm import moe_experts

    n_exp, inter, hid, top = 128, 1856, 2688, 6

    def stack(n, k):
        packed = torch.randint(0, 256, (n_exp, n, k // 2), dtype=torch.uint8, device=device)
        scale = (torch.rand(n_exp, n, k // 16, device=device) * 2 + 0.5).to(torch.float8_e4m3fn)
        return nvfp4.NVFP4Tensor(packed, scale, torch.full((n_exp,), 0.01, device=device))

    up, down = stack(inter, hid), stack(hid, inter)
    x = torch.randn(1, hid, device=device, dtype=torch.bfloat16)
    w = torch.full((1, top), 1 / top, device=device)
    g = torch.Generator(device="cpu").manual_seed(0)

    def pick():
        return torch.randperm(n_exp, generator=g)[:top].to(device).view(1, top)

    def slices(ids, stacks):
        return [t[e] for e in ids.view(-1).tolist() for s in stacks for t in (s.packed, s.block_scale)]

    def run(before, ids):
        before(ids)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            moe_experts(x, ids, w, up, down)
            torch.cuda.synchronize()
        return moe_launches(prof)

    def cold(ids):
        flush()

    def warm(ids):
        moe_experts(x, ids, w, up, down)

    def both(ids):
        flush()
        for t in slices(ids, (up, down)):
            prefetch(t, programs=8)

    def both_waited(ids):
        both(ids)
        torch.cuda._sleep(int(10 * cycles_per_us))

    def down_only(ids):
        flush()
        for t in slices(ids, (down,)):
            prefetch(t, programs=8)

    moe_experts(x, pick(), w, up, down)
    out = {}
    for name, before in (("cold", cold), ("warm", warm), ("prefetched_up_and_down", both),
                         ("prefetched_up_and_down_10us", both_waited), ("prefetched_down", down_only)):
        times = [run(before, pick()) for _ in range(reps)]
        out[name] = {"up_us": statistics.median(t[0] for t in times), "down_us": statistics.median(t[1] for t in times)}
        print(f"moe 1 token {name:30s} up {out[name]['up_us']:6.2f} down {out[name]['down_us']:6.2f}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--windows", default="0,3,6,12,25", help="us between the prefetch and the call")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/prefetch-<gpu>.json)")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("bench_prefetch.py needs a CUDA GPU of compute capability 9.0 or later (the bulk prefetch)")
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    l2 = props.L2_cache_size
    flush_buf = torch.empty(l2, dtype=torch.float32, device=device).normal_()  # 4 L2s of bytes
    cycles_per_us = sleep_rate()

    def flush():
        flush_buf.sum()

    rows = []
    for name, what, n, k in SHAPES:
        call, weights = operation(what, n, k, device)
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        cold = timed(call, flush, args.reps)
        warm = timed(call, call, args.reps)
        row = {"op": name, "kind": what, "n": n, "k": k, "weight_bytes": nbytes, "cold_us": cold, "warm_us": warm,
               "prefetched_us": {}}
        for variant, kw in VARIANTS:
            for window in (int(v) for v in args.windows.split(",")):
                def before(window=window, kw=kw):
                    flush()
                    for w in weights:
                        prefetch(w, **kw)
                    if window:
                        torch.cuda._sleep(int(window * cycles_per_us))
                row["prefetched_us"][f"{variant}@{window}"] = timed(call, before, args.reps)
        rows.append(row)
        print(f"{name:20s} {nbytes/1e6:6.1f} MB cold {cold:6.2f} warm {warm:6.2f} "
              + " ".join(f"{k}={v:.2f}" for k, v in row["prefetched_us"].items()), flush=True)

    # the prefetch launch's own time on the in_proj weight
    from torch.profiler import ProfilerActivity, profile

    launch = {}
    big = operation("fp8", 10304, 2688, device)[1][0]
    for variant, kw in VARIANTS:
        us = []
        for _ in range(args.reps):
            flush()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                prefetch(big, **kw)
                torch.cuda.synchronize()
            us.append(sum(e.self_device_time_total for e in prof.key_averages()
                          if e.device_type.name == "CUDA" and "_prefetch_kernel" in e.key))
        launch[variant] = statistics.median(us)
    print("prefetch launch us (27.7 MB):", launch)
    moe = moe_rows(flush, cycles_per_us, args.reps, device)
    doc = {**run_record(), "l2_bytes": l2, "reps": args.reps, "rows": rows, "prefetch_launch_us": launch, "moe": moe}
    path = write_results(doc, "prefetch", torch.cuda.get_device_name(device), out=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
