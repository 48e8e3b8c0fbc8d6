"""The bundled tiny Nemotron-H and the Shakespeare corpus it was trained on.

`fp4kit/data/tiny-nemotron-h/` is a real, trained `NemotronHForCausalLM` (Mamba-2, MoE and
attention layers; every quantized dimension a multiple of the NVFP4 block), small enough for
CPU tests. `scripts/train_tiny_model.py` rebuilds it; `benchmarks/results/tiny-model.json`
records its training and the held-out figures the tests check against.

The corpus (`fp4kit/data/corpus/{train,calibration,eval}.txt`) is split by play; within a split
file plays are separated by DOC_SEPARATOR. Token streams join documents with EOS after each.
"""

from __future__ import annotations

import importlib.resources
import pathlib

import torch

DOC_SEPARATOR = "\n\f\n"
SPLITS = ("train", "calibration", "eval")
# The fixed held-out slice the tests score: the first 4 x 512 tokens of the eval stream.
HELDOUT_ROWS = 4
HELDOUT_SEQ_LEN = 512


def _data_dir() -> pathlib.Path:
    return pathlib.Path(str(importlib.resources.files("fp4kit").joinpath("data")))


def tiny_model_path() -> pathlib.Path:
    """Directory of the bundled model: config.json, model.safetensors, tokenizer files."""
    return _data_dir() / "tiny-nemotron-h"


def corpus_path(split: str) -> pathlib.Path:
    if split not in SPLITS:
        raise ValueError(f"unknown corpus split {split!r}; expected one of {SPLITS}")
    return _data_dir() / "corpus" / f"{split}.txt"


def corpus_documents(split: str) -> list[str]:
    """The plays of one split, each as one string."""
    text = corpus_path(split).read_text(encoding="utf-8")
    return text.rstrip("\n").split(DOC_SEPARATOR)


def token_stream(tokenizer, documents: list[str]) -> torch.Tensor:
    """1-D int64 tensor: each document's tokens followed by EOS, no BOS."""
    ids: list[int] = []
    for doc in documents:
        ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def heldout_slice(tokenizer, rows: int = HELDOUT_ROWS, seq_len: int = HELDOUT_SEQ_LEN) -> torch.Tensor:
    """[rows, seq_len] token ids: the start of the eval stream, cut into rows."""
    # The first eval play alone is long enough; tokenizing it only keeps this fast on CPU.
    stream = token_stream(tokenizer, corpus_documents("eval")[:1])
    if stream.numel() < rows * seq_len:
        stream = token_stream(tokenizer, corpus_documents("eval"))
    return stream[: rows * seq_len].view(rows, seq_len)


def load_tiny_model(dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"):
    """(model, tokenizer) of the bundled model, in eval mode, from safetensors, no remote code."""
    from transformers import AutoTokenizer, NemotronHForCausalLM

    path = tiny_model_path()
    model = NemotronHForCausalLM.from_pretrained(path, dtype=dtype, device_map=device, use_safetensors=True)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
