"""Benchmarks of NVFP4 quantize (fp4kit.kernels.quantize) on a GPU, for scripts/bench_kernels.py:
the whole call and its launches, the stack kernel beside the two launches, and the one launch
with a given global amax."""

from __future__ import annotations

import torch

from fp4kit.kernels import launch, quantize as kquant


def bench(shapes=((128, 1856, 2688), (128, 2688, 1856), (8192, 8192)), dtype=torch.bfloat16) -> list:
    """Median times and achieved bandwidth (weight bytes in + packed bytes out) per shape and
    rule: the whole `quantize` call (eager, with its checks), its launches alone (`launch`,
    replayed from a CUDA graph: one `_stack_kernel` launch for a stack that `fused_stack`
    takes, else two), for such stacks also the two-launch path (max pass, then quantize), and
    the one launch with a given global amax (fused siblings, or a stack whose amax is known),
    side by side."""
    from triton.testing import do_bench, do_bench_cudagraph

    two = launch.override(launch.table("quantize", torch.device("cuda")), STACK={"max_member_bytes": None})
    rows = []
    for shape in shapes:
        w = torch.randn(shape, dtype=dtype, device="cuda")
        n_el = w.numel()
        n_members = n_el // (shape[-1] * shape[-2])
        traffic = n_el * w.element_size() + n_el // 2 + n_el // 16 + 4 * n_members
        row = {"shape": list(shape), "bytes": traffic}
        for rule in ("6", "4o6"):
            ms = do_bench(lambda: kquant.quantize(w, scale_rule=rule), warmup=25, rep=200, return_mode="median")
            row[f"ms_{rule}"] = ms
            row[f"tbps_{rule}"] = traffic / (ms * 1e-3) / 1e12
            ms_k = do_bench_cudagraph(lambda: kquant.launch(w, rule), rep=100, return_mode="median")
            row[f"ms_kernels_{rule}"] = ms_k
            row[f"tbps_kernels_{rule}"] = traffic / (ms_k * 1e-3) / 1e12
            if kquant.fused_stack(w, n_members, shape[-2] * shape[-1] // 16):  # the two launches, side by side
                ms_2 = do_bench_cudagraph(lambda: kquant.launch(w, rule, tables=two), rep=100, return_mode="median")
                row[f"ms_two_launches_{rule}"] = ms_2
                row[f"tbps_two_launches_{rule}"] = traffic / (ms_2 * 1e-3) / 1e12
            g = kquant.member_amax(w)
            ms_g = do_bench_cudagraph(lambda: kquant.launch(w, rule, global_amax=g), rep=100, return_mode="median")
            row[f"ms_given_amax_{rule}"] = ms_g
            row[f"tbps_given_amax_{rule}"] = traffic / (ms_g * 1e-3) / 1e12
        # The max pass alone (it reads the weight once more in the two-pass path).
        row["ms_amax_pass"] = do_bench_cudagraph(lambda: kquant.member_amax(w), rep=100, return_mode="median")
        row["ratio_4o6_to_plain"] = row["ms_4o6"] / row["ms_6"]
        row["ratio_4o6_to_plain_kernels"] = row["ms_kernels_4o6"] / row["ms_kernels_6"]
        rows.append(row)
    return rows
