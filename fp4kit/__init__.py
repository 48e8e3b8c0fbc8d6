"""fp4kit: NVFP4 quantization for hybrid Mamba/MoE Hugging Face models."""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "load_quantized":  # imported on first use: it pulls in transformers
        from .export.load import load_quantized

        return load_quantized
    if name == "generate":  # the static-buffer decode loop, fp4kit/decode.py
        from .decode import generate

        return generate
    raise AttributeError(f"module 'fp4kit' has no attribute {name!r}")
