"""Grouped W4A16 MoE for Nemotron-H's non-gated experts: out = sum_k w_k * down_e(relu(up_e x)^2).

Reference: transformers' `NemotronHExperts.forward` run on dequantized weights (backend="torch"
is that computation, `experts_reference`): up_proj [E, I, H] and down_proj [E, H, I] as 3-D NVFP4
stacks (one global scale per expert), router output as the model produces it (top-k expert ids
[T, k] and fp32 weights [T, k]).

One launch per projection:
- routing: the T*k (token, slot) assignments are sorted by expert (`torch.sort`, stable) and
  `offsets[e]` marks where expert e's run starts; no padding, no per-expert loop on the host.
- `_moe_up_kernel`, grid (E, I / BLOCK_N): a program takes one expert and one slice of its
  output features and walks that expert's run of assignments BLOCK_M rows at a time, gathering
  the token rows of `hidden`; experts with no tokens return at once. The dequantized weight tile
  is the GEMM's (`w4a16_gemm._accumulate`). Epilogue: round to the activation dtype (as the
  reference's linear output), relu, square, round again (as the reference's relu2), store the
  intermediate in sorted order.
- `_moe_down_kernel`, grid (E, H / BLOCK_N): the same walk over the intermediate; epilogue: round
  to the activation dtype, times the fp32 routing weight, stored per assignment in fp32.
- the k slots of each token are summed in fp32 (fixed order) and cast to the activation dtype.

Measured on an H200 against transformers' grouped_mm experts in bf16 (CUDA graphs, 128 experts,
top-6, H=2688, I=1856; benchmarks/results/kernels-h200.json): 1.45x at 1 token, 1.84x at 8,
1.76x at 64, 1.61x at 256, 0.65x at 2048. At decode sizes the per-expert tiles are few and the
weight tiles stream one ahead per program, so the grid is latency bound; the dequantization is
the GEMM's (about 7 instructions per weight in the loop).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4kit.formats import nvfp4
from fp4kit.formats.errors import FormatError

from .backend import check_backend, launch_options
from .w4a16_gemm import _ACT_DTYPES, _accumulate, check_weight, lut_tile, time_if_right, use_lut

_WHAT = "kernels.moe_experts"


@triton.jit
def _moe_up_kernel(
    x_ptr, order_ptr, offsets_ptr, wq_ptr, ws_ptr, gs_ptr, inter_ptr,
    H, I, TOPK,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    LUT: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
):
    e = tl.program_id(0)
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    if end > start:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < I
        n64 = n.to(tl.int64)
        e64 = e.to(tl.int64)
        wq = wq_ptr + e64 * I * (H // 8)
        ws = ws_ptr + e64 * I * (H // 16)
        gs = tl.load(gs_ptr + e)
        for m0 in range(start, end, BLOCK_M):
            pos = m0 + tl.arange(0, BLOCK_M)
            m_ok = pos < end
            assignment = tl.load(order_ptr + pos, mask=m_ok, other=0)
            token = (assignment // TOPK).to(tl.int64)
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc = _accumulate(acc, x_ptr, token * H, m_ok, wq, ws, gs, n64, n_ok, H, 0, H,
                              BLOCK_N, BLOCK_K, IEEE, LUT, EVEN_N, EVEN_K)
            h = acc.to(inter_ptr.dtype.element_ty).to(tl.float32)  # the linear's output dtype
            h = tl.maximum(h, 0.0)
            h = (h * h).to(inter_ptr.dtype.element_ty)  # relu2, rounded like torch's square
            tl.store(inter_ptr + pos[None, :].to(tl.int64) * I + n64[:, None], h,
                     mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _moe_down_kernel(
    inter_ptr, order_ptr, offsets_ptr, weight_ptr, wq_ptr, ws_ptr, gs_ptr, out_ptr,
    H, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    LUT: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    ACT_DTYPE: tl.constexpr,
):
    e = tl.program_id(0)
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    if end > start:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < H
        n64 = n.to(tl.int64)
        e64 = e.to(tl.int64)
        wq = wq_ptr + e64 * H * (I // 8)
        ws = ws_ptr + e64 * H * (I // 16)
        gs = tl.load(gs_ptr + e)
        for m0 in range(start, end, BLOCK_M):
            pos = m0 + tl.arange(0, BLOCK_M)
            m_ok = pos < end
            assignment = tl.load(order_ptr + pos, mask=m_ok, other=0)
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc = _accumulate(acc, inter_ptr, pos.to(tl.int64) * I, m_ok, wq, ws, gs, n64, n_ok,
                              I, 0, I, BLOCK_N, BLOCK_K, IEEE, LUT, EVEN_N, EVEN_K)
            route_w = tl.load(weight_ptr + assignment, mask=m_ok, other=0.0)
            y = acc.to(ACT_DTYPE).to(tl.float32) * route_w[None, :]
            tl.store(out_ptr + assignment[None, :].to(tl.int64) * H + n64[:, None], y,
                     mask=n_ok[:, None] & m_ok[None, :])


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _check_inputs(hidden, top_k_index, top_k_weights, up, down):
    check_weight(up, _WHAT + " up_proj", batch_dims=1)
    check_weight(down, _WHAT + " down_proj", batch_dims=1)
    e, i, h = up.shape
    if tuple(down.shape) != (e, h, i):
        raise FormatError(f"{_WHAT}: down_proj shape {down.shape} should be {(e, h, i)} for up_proj {up.shape}")
    if not isinstance(hidden, torch.Tensor) or hidden.dtype not in _ACT_DTYPES or hidden.dim() != 2 or hidden.shape[1] != h:
        raise FormatError(f"{_WHAT}: hidden_states must be a bf16/fp16/fp32 [T, {h}] tensor")
    t = hidden.shape[0]
    if top_k_index.dim() != 2 or top_k_index.shape[0] != t or top_k_index.dtype not in (torch.int32, torch.int64):
        raise FormatError(f"{_WHAT}: top_k_index must be an integer [T={t}, k] tensor, got {tuple(top_k_index.shape)}")
    if tuple(top_k_weights.shape) != tuple(top_k_index.shape) or not top_k_weights.is_floating_point():
        raise FormatError(f"{_WHAT}: top_k_weights must be a float tensor shaped like top_k_index")
    return e, i, h


def experts_reference(hidden, top_k_index, top_k_weights, up_w, down_w):
    """transformers' NemotronHExperts.forward on dense weights [E, I, H] / [E, H, I], restated:
    per expert, its tokens through up, relu^2, down, times the routing weight, added in the
    routing weights' dtype (fp32) in expert order; cast back to the activation dtype."""
    out = torch.zeros_like(hidden, dtype=top_k_weights.dtype)
    for expert in torch.unique(top_k_index).tolist():
        token, slot = torch.where(top_k_index == expert)
        h = torch.nn.functional.linear(hidden[token], up_w[expert])
        h = torch.square(torch.relu(h))
        y = torch.nn.functional.linear(h, down_w[expert]) * top_k_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out.to(hidden.dtype)


# Launch shape for decode-sized runs (up to 24 rows per expert), picked on an H200 by `sweep`
# (scripts/bench_kernels.py --sweep; benchmarks/results/kernels-h200.json).
MOE_DECODE = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}


def moe_config(assignments: int, n_experts: int, device: torch.device) -> dict:
    """BLOCK_M follows the mean number of rows per expert; decode sizes get 16."""
    per_expert = assignments / max(n_experts, 1)
    if per_expert <= 24:
        cfg = dict(BLOCK_M=16, **MOE_DECODE)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)
    if device.type != "cuda":
        cfg.update(BLOCK_N=32, BLOCK_K=64)
    return cfg


def sweep(tokens=(1, 8, 64), n_exp=128, top_k=6, hid=2688, inter=1856,
          shapes=((64, 128, 4), (32, 128, 4), (32, 256, 4), (64, 256, 4), (64, 256, 8), (128, 128, 8))):
    """CUDA-graph times of decode launch shapes (BLOCK_N, BLOCK_K, warps) on Nano's experts."""
    from .quantize import quantize

    up = quantize(torch.randn((n_exp, inter, hid), dtype=torch.bfloat16, device="cuda") * 0.02)
    down = quantize(torch.randn((n_exp, hid, inter), dtype=torch.bfloat16, device="cuda") * 0.02)
    out = []
    for t in tokens:
        h = torch.randn((t, hid), dtype=torch.bfloat16, device="cuda")
        ids = torch.rand((t, n_exp), device="cuda").topk(top_k, dim=-1).indices
        w = torch.rand((t, top_k), device="cuda")
        ref = moe_experts(h, ids, w, up, down, backend="torch").float()
        for bn, bk, nw in shapes:
            cfg = dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=3)
            row = {"tokens": t, **cfg}
            row.update(time_if_right(lambda: moe_experts(h, ids, w, up, down, cfg=cfg), ref))
            out.append(row)
    return out


def pick(rows) -> dict:
    """The MOE_DECODE entry with the smallest summed sweep time."""
    totals = {}
    for r in rows:
        key = (r["BLOCK_N"], r["BLOCK_K"], r["num_warps"])
        totals[key] = totals.get(key, 0.0) + (r["ms"] if r["ms"] is not None else float("inf"))
    bn, bk, nw = min(totals, key=totals.get)
    return {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": 3}


def moe_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                up_proj: nvfp4.NVFP4Tensor, down_proj: nvfp4.NVFP4Tensor, *, backend: str = "triton",
                cfg: dict | None = None) -> torch.Tensor:
    """Nemotron-H routed experts with NVFP4 weights: [T, H] -> [T, H] in hidden_states' dtype.

    backend: "triton" (two grouped launches) or "torch" (`experts_reference` on
    `up_proj.dequantize()` / `down_proj.dequantize()` in the activation dtype).
    """
    n_exp, inter, hid = _check_inputs(hidden_states, top_k_index, top_k_weights, up_proj, down_proj)
    check_backend(backend, _moe_up_kernel, hidden_states, top_k_index, top_k_weights, up_proj.packed.view(torch.int32),
                  down_proj.packed.view(torch.int32), what=_WHAT)
    dtype = hidden_states.dtype
    if backend == "torch":
        return experts_reference(hidden_states, top_k_index, top_k_weights,
                                 up_proj.dequantize(dtype), down_proj.dequantize(dtype))
    t, top_k = top_k_index.shape
    x = hidden_states.contiguous()
    device = x.device
    # Sort the assignments (token * k + slot) by expert; offsets[e]..offsets[e+1] is expert e's run.
    sorted_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
    bounds = torch.arange(n_exp + 1, device=device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds)  # int64, read as is by the kernels
    weights = top_k_weights.reshape(-1).to(torch.float32).contiguous()
    a = t * top_k
    cfg = dict(cfg or moe_config(a, n_exp, device))
    lut = cfg.pop("lut", lut_tile(cfg)) and use_lut(dtype, _moe_up_kernel)
    ieee = dtype == torch.float32
    inter_act = torch.empty((a, inter), dtype=dtype, device=device)
    _moe_up_kernel[(n_exp, triton.cdiv(inter, cfg["BLOCK_N"]))](
        x, order, offsets, up_proj.packed.view(torch.int32), up_proj.block_scale.view(torch.uint8), up_proj.global_scale,
        inter_act, hid, inter, top_k, IEEE=ieee, LUT=lut,
        EVEN_N=inter % cfg["BLOCK_N"] == 0, EVEN_K=hid % cfg["BLOCK_K"] == 0, **cfg, **launch_options())
    per_slot = torch.empty((a, hid), dtype=torch.float32, device=device)
    _moe_down_kernel[(n_exp, triton.cdiv(hid, cfg["BLOCK_N"]))](
        inter_act, order, offsets, weights, down_proj.packed.view(torch.int32), down_proj.block_scale.view(torch.uint8),
        down_proj.global_scale, per_slot, hid, inter, IEEE=ieee, LUT=lut,
        EVEN_N=hid % cfg["BLOCK_N"] == 0, EVEN_K=inter % cfg["BLOCK_K"] == 0, ACT_DTYPE=_TL_DTYPES[dtype],
        **cfg, **launch_options())
    return per_slot.view(t, top_k, hid).sum(dim=1).to(dtype)


# --------------------------------------------------------------------------------------------
# Benchmark entry
# --------------------------------------------------------------------------------------------
def _bf16_grouped_baseline(n_exp, hid, inter, top_k, up_w, down_w):
    """transformers' NemotronHExperts with experts_implementation="grouped_mm", else a direct
    torch._grouped_mm pipeline. Returns (callable(hidden, ids, weights), name)."""
    try:
        from transformers import NemotronHConfig
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

        cfg = NemotronHConfig(n_routed_experts=n_exp, hidden_size=hid, moe_intermediate_size=inter,
                              num_experts_per_tok=top_k, mlp_hidden_act="relu2")
        cfg._experts_implementation = "grouped_mm"
        mod = NemotronHExperts(cfg).to(device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            mod.up_proj.copy_(up_w)
            mod.down_proj.copy_(down_w)
        return (lambda h, i, w: mod(h, i, w)), "transformers NemotronHExperts (grouped_mm)"
    except Exception as exc:  # noqa: BLE001 -- the fallback is named in the results
        reason = f"{type(exc).__name__}: {exc}"

    def run(h, ids, w):
        sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
        counts = torch.bincount(sorted_ids, minlength=n_exp)
        offs = counts.cumsum(0).to(torch.int32)
        xs = h[order // top_k]
        y = torch._grouped_mm(xs, up_w.transpose(1, 2), offs=offs)
        y = torch.square(torch.relu(y))
        y = torch._grouped_mm(y, down_w.transpose(1, 2), offs=offs) * w.reshape(-1)[order, None]
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        out.index_add_(0, order // top_k, y.float())
        return out.to(h.dtype)

    return run, f"torch._grouped_mm ({reason})"


def bench(tokens=(1, 8, 64, 256, 2048), n_exp=128, top_k=6, hid=2688, inter=1856):
    """Median times of this grouped kernel and of a bf16 grouped baseline, side by side: CUDA
    graph replays where the call can be captured, and eager."""
    from triton.testing import do_bench, do_bench_cudagraph

    from .quantize import quantize

    up_w = torch.randn((n_exp, inter, hid), dtype=torch.bfloat16, device="cuda") * 0.02
    down_w = torch.randn((n_exp, hid, inter), dtype=torch.bfloat16, device="cuda") * 0.02
    up_q, down_q = quantize(up_w), quantize(down_w)
    baseline, name = _bf16_grouped_baseline(n_exp, hid, inter, top_k, up_w, down_w)

    def graph_time(fn):
        try:
            return do_bench_cudagraph(fn, rep=50, return_mode="median"), None
        except Exception as exc:  # noqa: BLE001 -- e.g. a host sync inside the baseline
            torch.cuda.synchronize()
            return None, f"{type(exc).__name__}: {str(exc)[:120]}"

    rows = []
    for t in tokens:
        h = torch.randn((t, hid), dtype=torch.bfloat16, device="cuda")
        scores = torch.rand((t, n_exp), device="cuda")
        ids = scores.topk(top_k, dim=-1).indices
        w = torch.rand((t, top_k), device="cuda")
        with torch.no_grad():
            fp4 = lambda: moe_experts(h, ids, w, up_q, down_q)  # noqa: E731
            bf16 = lambda: baseline(h, ids, w)  # noqa: E731
            row = {"tokens": t, "baseline": name}
            row["ms_w4a16_eager"] = do_bench(fp4, warmup=10, rep=50, return_mode="median")
            row["ms_bf16_eager"] = do_bench(bf16, warmup=10, rep=50, return_mode="median")
            row["ms_w4a16_graph"], row["graph_error_w4a16"] = graph_time(fp4)
            row["ms_bf16_graph"], row["graph_error_bf16"] = graph_time(bf16)
            both_graphs = row["ms_w4a16_graph"] is not None and row["ms_bf16_graph"] is not None
            row["timing"] = "cuda-graph" if both_graphs else "eager"
            row["ms_w4a16"] = row["ms_w4a16_graph"] if both_graphs else row["ms_w4a16_eager"]
            row["ms_bf16"] = row["ms_bf16_graph"] if both_graphs else row["ms_bf16_eager"]
            row["speedup_vs_bf16"] = row["ms_bf16"] / row["ms_w4a16"]
            row["speedup_vs_bf16_eager"] = row["ms_bf16_eager"] / row["ms_w4a16_eager"]
            ref = baseline(h, ids, w).float()
            got = fp4().float()
            row["rel_diff_vs_bf16_weights"] = float((got - ref).norm() / ref.norm())
        rows.append(row)
    return rows
