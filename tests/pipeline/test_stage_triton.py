"""The quantize stage on the Triton kernels (in Triton's interpreter here; tests/gpu on a GPU):
the torch stage's bytes, SQNR and 4/6 fractions, with every data check and error term read back
after the last weight is queued."""

import pytest
import torch
import yaml

pytest.importorskip("triton")

from fp4kit.formats import FormatError  # noqa: E402
from fp4kit.quantize import quantize, quantize_weights  # noqa: E402
from fp4kit.recipe import load_recipe, recipe_from_dict  # noqa: E402

from tiny_models import IMPORTANCE_RECIPE, build_llama, build_nemotron_h  # noqa: E402


def _bytes(t):
    return t.reshape(-1).view(torch.uint8)


def _stage(qm, backend):
    return quantize_weights(qm.plan, qm.stats, backend=backend, progress=False, warnings=[], arith=qm.arith)


def _recipe(name):
    return recipe_from_dict(yaml.safe_load(IMPORTANCE_RECIPE)) if name == "importance" else load_recipe(name)


@pytest.mark.parametrize("family,recipe", [
    ("nemotron_h", "nemotron-h-w4a16-4o6"),  # expert stacks (the stack kernel), FP8 Mamba projections
    ("nemotron_h", "importance"),  # 4/6 weighted by E[x^2]: the importance rows' checks
    ("llama", "nvfp4-w4a16"),  # q/k/v and gate/up sharing a global amax: the covering checks
    ("llama", "fp8"),
])
def test_the_triton_stage_gives_the_torch_stages_results(family, recipe, token_samples):
    model = build_nemotron_h() if family == "nemotron_h" else build_llama()
    qm = quantize(model, _recipe(recipe), token_samples[:2, :16], progress=False)
    got, want = _stage(qm, "triton"), qm.quantized
    assert list(got) == list(want)
    for key, q in want.items():
        g = got[key]
        assert set(g.tensors) == set(q.tensors)
        for name, parts in q.tensors.items():
            assert len(g.tensors[name]) == len(parts)
            for a, b in zip(g.tensors[name], parts):
                assert torch.equal(_bytes(a), _bytes(b)), (key, name)
        assert g.sqnr_db == pytest.approx(q.sqnr_db, rel=1e-6), key
        assert g.frac4 == q.frac4, key  # counts of blocks, divided on the host in float64


@pytest.mark.parametrize("stack", [True, False])
def test_a_nan_weight_is_named_by_the_triton_stage_as_by_the_torch_stage(stack, token_samples):
    model = build_nemotron_h()
    qm = quantize(model, load_recipe("nemotron-h-w4a16-4o6"), token_samples[:2, :16], progress=False)
    target = next(p.target for p in qm.plan if p.rule is not None and p.target.is_stack == stack)
    with torch.no_grad():
        target.weight[(5, 7, 3) if stack else (7, 3)] = float("nan")
    messages = []
    for backend in ("torch", "triton"):
        with pytest.raises(FormatError) as err:
            _stage(qm, backend)
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    name = target.disk_names[5] if stack else target.disk_names[0]
    assert messages[1].startswith(f"{name}.weight (") and "1 NaN and 0 Inf values (first at (7, 3))" in messages[1]


def test_queueing_a_weight_launches_few_torch_operations_beside_its_kernels(monkeypatch, token_samples):
    # Each torch kernel a weight's queueing launches costs host time and a gap on the GPU: the
    # data checks and the error terms are kept for the read-back, not reduced per weight, and the
    # FP8 scale is made in its kernel (left: the zeroed counters or maxima a launch adds into).
    # Counted: torch operations other than views and allocations, outside the Triton launches.
    import triton.runtime.interpreter as interpreter
    from torch.utils._python_dispatch import TorchDispatchMode

    from fp4kit.quantize import queue_weights

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.launches, self.inside = [], 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not (self.inside or func.is_view or func.name().startswith(("aten::empty", "aten::scalar_tensor"))):
                self.ops.append(func.name())
            return func(*args, **(kwargs or {}))

    count = Count()
    launch = interpreter.GridExecutor.__call__

    def counted(self, *args, **kwargs):
        count.inside += 1
        count.launches += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            count.inside -= 1

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counted)
    qm = quantize(build_nemotron_h(), load_recipe("nemotron-h-w4a16-4o6"), token_samples[:2, :16], progress=False)
    weights = [p for p in qm.plan if p.rule is not None]
    with count:
        queue_weights(qm.plan, qm.stats, backend="triton", progress=False, warnings=[], arith=qm.arith)
    assert count.launches >= len(weights)
    assert len(count.ops) <= 1.5 * len(weights), sorted(count.ops)


def test_the_read_back_adds_every_weights_partial_sums_in_a_few_operations(op_counter):
    # The stage adds up each weight's per-program partial sums after the last weight is queued:
    # one reduction per weight would put hundreds of small kernels behind the last quantize kernel.
    from fp4kit.quantize import _column_sums

    def parts(n):
        g = torch.Generator().manual_seed(n)
        # [programs, 3] float32 (NVFP4 kernels), [1, 2] float64 (FP8 terms, the torch stage), one empty
        return [torch.randn(i % 7, 3, generator=g) if i % 3 else torch.randn(1, 2, generator=g, dtype=torch.float64)
                for i in range(n)]

    counts = []
    for n in (4, 60):
        given = parts(n)
        with op_counter() as c:
            got = _column_sums(given)
        counts.append(c.ops)
        for p, s in zip(given, got):
            assert s.dtype == torch.float64 and s.shape == (p.shape[1],)
            torch.testing.assert_close(s, p.sum(0, dtype=torch.float64), rtol=1e-15, atol=1e-15)
    assert counts[0] == counts[1], counts
