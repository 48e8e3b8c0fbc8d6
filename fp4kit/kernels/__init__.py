"""Triton kernels for Hopper GPUs, each checked against its fp4kit.formats reference.

    quantize.py     NVFP4 quantization (rules "6" and "4o6"), bytes identical to nvfp4.quantize
    w4a16_gemm.py   y = x @ dequant(W)^T for an NVFP4 weight in checkpoint layout
    packed_gemm.py  the same on a weight re-laid out once (`pack`) for register-fed wgmma
    moe_gemm.py     Nemotron-H routed experts (up, relu^2, down) on 3-D NVFP4 stacks
    backend.py      the backend switch: "triton" or "torch" (the reference)

The modules are not imported here: Triton decides at decoration time (module import) whether
kernels run compiled (CUDA) or in its CPU interpreter (TRITON_INTERPRET=1), so importing them is
left to the caller. Each needs the `triton` package (the dev extra on CPU machines).
"""
