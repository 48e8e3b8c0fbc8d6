"""Benchmark of the grouped MoE (fp4kit.kernels.moe_gemm) on a GPU, for scripts/bench_kernels.py:
Nemotron-3-Nano's experts against a bf16 grouped baseline (transformers' grouped_mm experts)."""

from __future__ import annotations

import torch

from fp4kit.kernels import launch, moe_gemm as mg
from fp4kit.kernels.quantize import quantize


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

    tables = launch.table("moe")
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
            fp4 = lambda: mg.moe_experts(h, ids, w, up_q, down_q)  # noqa: E731
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
            a = t * top_k
            cfg = mg.moe_config(a, n_exp, h.device)
            row["path"] = ("small-gemv" if cfg.get("gemv") else "sorted-mma" if cfg.get("mma") else
                           "small" if a <= tables["SMALL"]["max_assignments"] else "sorted")
            if row["path"] != "sorted":  # the wgmma paths at the same size, for the record
                base = mg.matrix_unit_config(a, n_exp, h.device)
                row["ms_w4a16_sorted_graph"], _ = graph_time(
                    lambda: mg.moe_experts(h, ids, w, up_q, down_q, cfg=dict(base, small=False)))
                if row["path"] == "small-gemv":
                    row["ms_w4a16_small_matrix_unit_graph"], _ = graph_time(
                        lambda: mg.moe_experts(h, ids, w, up_q, down_q, cfg=dict(base, small=True)))
                if row["path"] != "sorted-mma":
                    row["ms_w4a16_sorted_mma_graph"], _ = graph_time(
                        lambda: mg.moe_experts(h, ids, w, up_q, down_q, cfg=dict(mg.moe_mma_config(), small=False)))
        rows.append(row)
    return rows
