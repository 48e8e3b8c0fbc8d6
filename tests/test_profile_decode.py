"""scripts/profile_decode.py: kernels are grouped by kind from their names (names as an H200
profile of a decode step shows them), and a step's figures are the difference of two runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
_spec = importlib.util.spec_from_file_location("profile_decode", ROOT / "scripts" / "profile_decode.py")
profile_decode = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(profile_decode)


@pytest.mark.parametrize("name, kind", [
    ("_moe_small_kernel", "fp4kit kernels"),
    ("_gemv_kernel", "fp4kit kernels"),
    ("_round_kernel", "fp4kit kernels"),
    ("_route_kernel", "fp4kit kernels"),
    ("_decode_attention_kernel", "fp4kit kernels"),
    ("_mamba_step_kernel", "fp4kit kernels"),
    ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "bf16 matmul"),
    ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_s", "bf16 matmul"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "bf16 matmul"),
    ("aten::_grouped_mm", "bf16 matmul"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)", "copy"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 1, false>", "top-k and sort"),
    ("void at::native::bitonicSortKVInPlace<-2, -1, 16, 16, float, long>", "top-k and sort"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "reduction"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
    ("aten::mul", "elementwise"),
    ("aten::select", "other"),
])
def test_kernels_are_grouped_by_name(name, kind):
    assert profile_decode.kind_of(name) == kind


def test_a_step_is_the_difference_of_two_runs_per_step():
    full = {"copy": {"us": 130.0, "count": 40}, "bf16 matmul": {"us": 70.0, "count": 12}}
    one = {"copy": {"us": 30.0, "count": 10}, "other": {"us": 5.0, "count": 1}}
    assert profile_decode.per_step(full, one, 10) == {
        "bf16 matmul": {"us": 7.0, "count": 1.2}, "copy": {"us": 10.0, "count": 3.0}, "other": {"us": -0.5, "count": -0.1}}


def test_kernels_are_summed_by_kind_and_the_slowest_listed_by_name():
    step = {"_gemv_kernel": {"us": 40.0, "count": 2}, "_moe_small_kernel": {"us": 25.0, "count": 1},
            "Memcpy DtoD (Device -> Device)": {"us": 5.0, "count": 3}, "aten::mul": {"us": 50.0, "count": 4}}
    assert profile_decode.by_kind(step) == {"fp4kit kernels": {"us": 65.0, "count": 3}, "copy": {"us": 5.0, "count": 3},
                                            "elementwise": {"us": 50.0, "count": 4}}
    assert profile_decode.top_kernels(step, 2) == [
        {"kernel": "aten::mul", "kind": "elementwise", "us": 50.0, "count": 4},
        {"kernel": "_gemv_kernel", "kind": "fp4kit kernels", "us": 40.0, "count": 2}]


def test_the_tiny_run_profiles_every_model_under_each_step_ops(tmp_path):
    import json
    import os
    import subprocess

    out = tmp_path / "profile.json"
    subprocess.run([sys.executable, "scripts/profile_decode.py", "--device", "cpu", "--tiny", "--steps", "2",
                    "--prompt-len", "8", "--step-ops", "fp4kit,transformers", "--reps", "1", "--out", str(out)],
                   cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True, capture_output=True, text=True,
                   timeout=600)
    doc = json.loads(out.read_text())
    names = ["bf16", "nemotron-h-w4a16-4o6", "bf16 (transformers ops)", "nemotron-h-w4a16-4o6 (transformers ops)"]
    assert doc["step_ops"] == ["fp4kit", "transformers"] and doc["inductor_pdl"] is False
    assert sorted(doc["per_step"]) == sorted(doc["per_step_total_us"]) == sorted(names)
    for name in names:
        assert doc["per_step_total_us"][name] == pytest.approx(sum(v["us"] for v in doc["per_step"][name].values()))
        assert doc["per_step_kernels"][name] == pytest.approx(sum(v["count"] for v in doc["per_step"][name].values()))
        assert doc["per_step_wall_us"][name] > 0
        assert doc["per_step_idle_us"][name] == pytest.approx(doc["per_step_wall_us"][name] - doc["per_step_total_us"][name])
    # transformers' Mamba decode contracts the state with C by bmm; fp4kit's element-wise form does not.
    assert doc["per_step"]["bf16 (transformers ops)"]["bf16 matmul"]["count"] > doc["per_step"]["bf16"]["bf16 matmul"]["count"]


def _k(name, start, end, stream=7):
    return {"name": name, "stream": stream, "start": start, "end": end}


def test_a_moe_block_is_timed_from_its_input_to_the_join_of_its_streams():
    # One decode step as an H200 timeline shows it (times in us): the norm before the router, the
    # router, the routed experts' two launches on one stream, the shared expert's GEMVs and
    # elementwise kernels on another, then the compiled kernel that adds the two. A block whose
    # experts are not fp4kit's (BF16's grouped GEMM) is not counted.
    step = [
        _k("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, ArgMaxOps<float>>>", 0.0, 1.0),
        _k("triton_red_fused_add_mean_route_rsqrt", 10.0, 12.5),
        _k("_gemv_kernel", 13.0, 18.0, 9),
        _k("_route_kernel", 13.1, 19.1),
        _k("_moe_small_kernel", 19.5, 33.5, 11),
        _k("_moe_small_kernel", 24.0, 43.0, 11),
        _k("void at::native::vectorized_elementwise_kernel<8, clamp>", 33.6, 35.0, 9),
        _k("_gemv_kernel", 36.0, 45.5, 9),
        _k("triton_red_fused_add_mean_rsqrt", 45.7, 48.0),
        _k("triton_red_fused_add_mean_route_rsqrt", 60.0, 62.0),
        _k("_route_kernel", 62.5, 68.5),
        _k("_ZN7cutlass13device_kernel_grouped_mm", 69.0, 90.0),
        _k("triton_poi_fused_add", 91.0, 92.0),
        _k("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, ArgMaxOps<float>>>", 95.0, 96.0),
    ]
    (block,) = profile_decode.moe_blocks(step[1:])
    assert block == {"block": 45.7 - 12.5, "router_end": 19.1 - 12.5, "routed_end": 43.0 - 12.5,
                     "shared_end": 45.5 - 12.5}
    timeline = [_k("triton_poi_fused_embedding", -20.0, -19.0), *step,
                *[dict(k, start=k["start"] + 100, end=k["end"] + 100) for k in step[1:]]]
    assert profile_decode.last_step(timeline) == [dict(k, start=k["start"] + 100, end=k["end"] + 100) for k in step[1:]]
    assert profile_decode.last_step(step) == []  # two picks: no step with one before it
    summary = profile_decode.summarize_blocks([block, dict(block, shared_end=None)])
    assert summary == {"blocks": 2, "block_total": 66.4, "block": [33.2, 33.2], "router_end": [6.6, 6.6],
                       "routed_end": [30.5, 30.5], "shared_end": [33.0, None]}
