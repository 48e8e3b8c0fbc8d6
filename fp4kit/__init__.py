"""fp4kit: NVFP4 quantization for hybrid Mamba/MoE Hugging Face models."""

__version__ = "0.1.0"
