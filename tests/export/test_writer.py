"""The shard writer: safetensors files byte-identical to `safetensors.torch.save_file`'s, shards
split at the size limit, an index naming every tensor once."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp4kit.export.writer import ShardWriter, safetensors_layout, write_safetensors


def _every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, dtype in enumerate([torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                               torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn,
                               torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64, torch.float8_e8m0fnu]):
        bits = torch.randint(0, 256, (3 + i, 5), generator=g, dtype=torch.uint8)
        out[f"t{i:02d}.{str(dtype).split('.')[1]}"] = bits.view(dtype) if dtype.itemsize == 1 else \
            torch.randint(0, 256, (3 + i, 5 * dtype.itemsize), generator=g, dtype=torch.uint8).view(dtype)
    return out


@pytest.mark.parametrize("metadata", [{"format": "pt"}, None])
def test_bytes_equal_save_files_for_every_dtype_and_shape(tmp_path, metadata):
    tensors = _every_dtype()
    tensors.update({
        "scalar": torch.tensor(0.37),
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
        "b.shared": torch.randn(8, dtype=torch.float32),
        "a.shared": torch.randn(2, 3, dtype=torch.float32),
        "unicodé.name": torch.arange(6, dtype=torch.int32),
        "view.of.a.stack": torch.randn(3, 16, 8).to(torch.bfloat16).unbind(0)[1],
        "transposed": torch.randn(4, 6).t(),
    })
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "ref.safetensors", metadata)
    write_safetensors(tensors, tmp_path / "ours.safetensors", metadata)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_layout_orders_by_dtype_then_name_and_pads_the_header():
    header, order = safetensors_layout({"b": torch.zeros(1, dtype=torch.uint8), "a": torch.zeros(1, dtype=torch.uint8),
                                         "z": torch.zeros(1, dtype=torch.float32)}, {"format": "pt"})
    assert order == ["z", "a", "b"]
    n = int.from_bytes(header[:8], "little")
    assert n % 8 == 0 and len(header) == 8 + n
    assert list(json.loads(header[8:])) == ["__metadata__", "z", "a", "b"]


def test_a_dtype_safetensors_cannot_name_is_refused(tmp_path):
    with pytest.raises(ValueError, match="complex64"):
        write_safetensors({"c": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "x.safetensors")


def test_shards_split_at_the_limit_and_the_index_names_every_tensor_once(tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = {f"layer.{i}.weight": torch.randn(10, 10, generator=g).to(torch.bfloat16) for i in range(7)}  # 200 B each
    writer = ShardWriter(tmp_path, max_shard_bytes=450)
    for k, v in tensors.items():
        writer.add(k, v)
    with pytest.raises(ValueError, match="written twice"):
        writer.add("layer.0.weight", tensors["layer.0.weight"])
    files = writer.close()
    shards = [f for f in files if f.endswith(".safetensors")]
    assert shards == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 7 * 200
    assert sorted(index["weight_map"]) == sorted(tensors)
    for f in shards:
        got = load_file(tmp_path / f)
        assert 1 <= len(got) <= 2
        for k, v in got.items():
            assert index["weight_map"][k] == f and torch.equal(v, tensors[k])
    assert not list(tmp_path.glob("*.tmp"))


def test_one_shard_is_model_safetensors(tmp_path):
    writer = ShardWriter(tmp_path)
    writer.add("w", torch.ones(4))
    assert writer.close() == ["model.safetensors"]
    assert torch.equal(load_file(tmp_path / "model.safetensors")["w"], torch.ones(4))


def test_a_failed_shard_write_raises_on_close(tmp_path):
    writer = ShardWriter(tmp_path / "missing-folder", max_shard_bytes=8)
    writer.add("a", torch.ones(4))
    writer.add("b", torch.ones(4))
    with pytest.raises(FileNotFoundError):
        writer.close()
