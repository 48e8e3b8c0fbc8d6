"""Mutation testing of the number formats and the ModelOpt exporter with mutmut 3, and the score.

    pip install -e '.[mutation]'
    python scripts/mutation_score.py                              # a full run from scratch
    python scripts/mutation_score.py fp4kit/formats/e4m3.py ...   # rerun the mutants of some files
    python scripts/mutation_score.py --resume                     # finish an interrupted run
    python scripts/mutation_score.py --survivors fp4kit/verify.py # retest only the survivors of some files
    python scripts/mutation_score.py --report-only                # only read mutants/ and write the JSON

mutmut reads [tool.mutmut] in pyproject.toml (files, tests, time limits), copies the package into
mutants/ and runs, for every mutant, the tests that reached its function. A full run deletes
mutants/ first; a run over files keeps it and retests every mutant of those files (or, with
--survivors, only those that survived). Then this writes benchmarks/results/mutation.json: per
file the mutants killed, timed out, survived and without a test; the survivors no test can tell from the code (EQUIVALENT below, with the reason) and those
only a CUDA device can tell (CUDA_ONLY: a tensor made on the CPU where the input's device was
meant; tests/formats/test_mutation_scales.py's CUDA test kills them on a GPU); and the score

    score = (killed + timeout) / (total - equivalent - cuda_only)

(and score_checked, the same over the mutants tested so far, for a run not yet finished)

A survivor neither names is listed as unexplained, and the command exits 1.
docs/mutation.md explains every entry; its score and survivor tables are written by this script
(between the `<!-- mutation:... -->` markers).

mutmut forgets every result when [tool.mutmut]'s test selection changes. A file whose mutants
mutants/ holds no result for, and which the previous mutation.json measured in full, keeps that
file's entry and survivors (re-judged against the tables below), with the date it was measured.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from benchlib.record import run_record  # noqa: E402

# (function, the mutated line as mutmut writes it) -> why no test can tell the mutant from the code.
# A function is named as in mutmut's mutant names, without the `x_` prefix and the mutant number.
CPU_SCALAR = "a 0-d CPU tensor enters an op on any device as a scalar: the same value, the same bytes"
FP32_DEFAULT = "torch's default dtype makes the same fp32 tensor of a Python float"
# ModelOpt 0.47's NVFP4QTensor.get_weights_scaling_factor_from_quantizer, static path (a quantizer with global_amax)
AMAX_VIEW = "ModelOpt views the per-block amax as [..., K/16] whatever its shape: only the number of values counts"
UNREAD_BLOCK_SIZES = "ModelOpt reads only block_sizes[-1] and block_sizes['four_over_six'] of a static quantizer"
SCALE2_DEFAULT = ("without weights_scaling_factor_2 ModelOpt computes it from the same quantizer, by the call the line "
                  "before makes: the same global scale")
NO_TOKENIZER = "load_model loads a tokenizer only for a true `tokenizer`: None and False both load none"
NO_BIAS = "ModelOpt calibrates the weight quantizer from the weight alone (no forward pass): a bias is never read"
ONLY_WEIGHT_QUANTIZER = ("the weight scale comes from the weight quantizer alone, which the next entry configures; "
                         "the input and output quantizers, enabled or not, see no data without a forward pass")
SUB_ONLY = "the clamp only keeps the shift of lanes that do not use `sub` (e >= 113 or e < 90) in range"
E_113 = ("at e = 113 both formulas give 2^23 | mantissa: (mag & 0x7FFFFF | 2^23) >> 0 equals mag - (112 << 23)")
ARANGE_INT64 = "torch.arange of Python integers is int64"
ONE_D = "the tensor has one dimension before it (two for `words`): dimension +1 is dimension -1"
PHILOX_MOVES_KEY = "philox4x32 moves the key to the counter's device"
BITS_MOVED = "round_stochastic moves the random bits to x's device: the same bits, drawn on the CPU"
KEEPS_DEVICE = "torch.as_tensor(t, device=None) keeps a tensor where it is, and a list has no device to keep"
LOW_16 = "torch's int64 -> int16 conversion keeps the low 16 bits, and the mutant changes only bits above them"
PATH_MATCH = ("redundant: the test f'.{entry}.' in f'.{name}.' decides alone, and the name's outer dots change it only "
              "for an entry that starts with a dot, which no module path does")
TP_CHECKS = "these Checks are only printed, by tensor and detail: their name is not shown and ok None prints as False"
SAME_BYTES_ANYWHERE = ("the source is re-derived on the CPU instead of the asked device: the formats give the same bytes "
                       "on either (in the checkpoint's recorded arithmetic), only slower")
EQUIVALENT = {
    ("fp4kit.verify.rederive", 'if getattr(model.config, "tie_word_embeddings", False) or "lm_head" in name:'):
        "an untied lm_head is a plan target (role lm_head in both adapters) and never reaches this loop; a tied one is skipped by either test",
    ("fp4kit.verify.rederive", "break"):
        "here (a tied lm_head missing, as the export leaves it) lm_head is the last entry of a causal LM's state_dict: nothing follows it",
    ("fp4kit.verify.rederive", "carried = unloaded_source_tensors(model, source_dir if (source_dir.is_dir()) or True else None)"):
        "a source that is not a folder (a hub id) holds no *.safetensors there: unloaded_source_tensors returns [] either way",
    # conformance
    ("fp4kit.export.conformance._read_json", 'return json.loads(path.read_text(encoding="UTF-8")), None'): "Python codec lookup is case-insensitive, so \"UTF-8\" and \"utf-8\" name the same codec.",
    ("fp4kit.export.conformance.read_safetensors_header", 'header = json.loads(raw.decode("UTF-8"), object_pairs_hook=_no_duplicate_keys)'): "bytes.decode looks the codec up case-insensitively, so \"UTF-8\" is the same codec as \"utf-8\".",
    ("fp4kit.export.conformance._Checker.__init__", 'self.kv_fp8 = None'): "kv_fp8 is only read as `not self.kv_fp8` in _check_kv, where None and False behave the same.",
    ("fp4kit.export.conformance._Checker.__init__", 'self.hf_quant: dict = None'): "run() always calls _check_quant_config, which sets self.hf_quant before anything reads it (_check_producer, _flat_view are only reached from there).",
    ("fp4kit.export.conformance._Checker.__init__", 'self.incomplete = None'): "incomplete is only read in boolean tests (`if self.incomplete`, `not self.incomplete`), where None and False behave the same.",
    ("fp4kit.export.conformance._Checker._check_experts", 'break'): "`if not sigs` is never true: proj comes from the projections some expert has, so at least one expert adds to sigs and the continue/break is unreachable.",
    ("fp4kit.export.conformance._Checker._check_experts", 'common = Counter(sigs.values()).most_common(None)[0][0]'): "most_common(None) sorts by count with a stable sort and most_common(1) uses heapq.nlargest, which is documented equal to sorted(...)[:1], so element [0] is the same, ties included.",
    ("fp4kit.export.conformance._Checker._check_experts", 'common = Counter(sigs.values()).most_common(2)[0][0]'): "heapq.nlargest(2) is equivalent to sorted(..., reverse=True)[:2] (stable), so its first element is the same as most_common(1)'s, ties included.",
    ("fp4kit.export.conformance._Checker._check_f32_scale", 'values = np.concatenate(list(self._chunks(t)) or [np.zeros(0, None)]).view("<f4")'): "The fallback is an empty array either way (float64 instead of uint8); an empty array views as an empty float32 array, so no finding changes.",
    ("fp4kit.export.conformance._Checker._check_f32_scale", 'values = np.concatenate(list(self._chunks(t)) or [np.zeros(0, )]).view("<f4")'): "np.zeros(0) is an empty float64 array; viewed as <f4 it is empty like the uint8 fallback, so no finding changes.",
    ("fp4kit.export.conformance._Checker._check_fused_scales", 'if fused is not None and module.rpartition(".")[2] != fused[1][0]:'): "_fused returns a group only when all its shards (at least two) are present, so the other shards register the same group key with the same members list, and the groups dict is identical.",
    ("fp4kit.export.conformance._Checker._check_fused_scales", 'if fused is not None and module.rpartition(".")[2] == fused[1][1]:'): "Every fused group has at least two shards and _fused needs all of them present, so registering the group from the second shard gives the same key and members as the first.",
    ("fp4kit.export.conformance._Checker._check_fused_scales", 'expert = _EXPERT.match(members[1]) is not None'): "All members share one parent and differ only in the last dotted part, which _EXPERT matches as [^.]+, so members[0] and members[1] match or fail together.",
    ("fp4kit.export.conformance._Checker._check_hybrid_pattern", 'if isinstance(blocks, list) and "".join(_BLOCK_LETTER.get(b, "XX?XX") for b in blocks) != pattern:'): "pattern was checked to use only 'M*-E', so a string containing '?' or 'XX?XX' never equals it; the comparison gives the same result either way.",
    ("fp4kit.export.conformance._Checker._check_numerics", 'self._scan_e4m3(name, t, positive=None)'): "_scan_e4m3 only tests positive for truth (`if positive`, `... if positive else ...`), where None and False are the same.",
    ("fp4kit.export.conformance._Checker._check_quant_config", 'self.hf_quant = hf_quant if (isinstance(hf_quant, dict)) or True else {}'): "self.hf_quant is read only in _flat_view/_check_producer, which are reached only after `nested` was checked to be a dict, which requires hf_quant to be a dict.",
    ("fp4kit.export.conformance._Checker._check_tensors", 'k = w.shape[1] * 2 if (algo in NVFP4_ALGOS) or True else w.shape[1]'): "k is used only in the NVFP4 branches (the K%16 check is guarded by `and algo in NVFP4_ALGOS`, and the weight_scale shape), so doubling it for FP8 changes nothing.",
    ("fp4kit.export.conformance._Checker.run", 'self._check_experts(config if (isinstance(config, dict)) or True else {})'): "_check_experts runs only when self.algo is set, and _check_quant_config sets algo only when config is a dict (flat is None and it returns early otherwise), so config is always a dict there.",
    # verify
    ("fp4kit.verify._expected_nvfp4", "g = torch.as_tensor(global_amax if global_amax is not None else w.abs().amax().float(), dtype=None)"):
        "both values are float32 already (a fused group's amax and w.abs().amax().float())",
    ("fp4kit.verify._expected_nvfp4", "g = torch.as_tensor(global_amax if global_amax is not None else w.abs().amax().float(), )"):
        "both values are float32 already (a fused group's amax and w.abs().amax().float())",
    ("fp4kit.verify.kv_scales_as_bf16", "value = torch.frombuffer(bytearray(f.read(None)), dtype=torch.float32)[0]"):
        "reads the rest of the file instead of its 4 bytes; the first float is the same",
    ("fp4kit.verify.verify", "rederive(report, folder, source, device=None)"): SAME_BYTES_ANYWHERE,
    ("fp4kit.verify.verify", "rederive(report, folder, source, )"): SAME_BYTES_ANYWHERE,
    **{("fp4kit.verify.rederive", line): "every transformers config defines tie_word_embeddings: the default is never taken"
       for line in ('if getattr(model.config, "tie_word_embeddings", True) and "lm_head" in name:',
                    'if getattr(model.config, "tie_word_embeddings", None) and "lm_head" in name:',
                    'if getattr(model.config, "tie_word_embeddings", ) and "lm_head" in name:')},
    # fp16sr.round_stochastic: the int64 -> int16 conversion keeps the low 16 bits, which the
    # where (which only subtracts 2^16 from sign | h >= 2^15) leaves as they are
    **{("fp4kit.formats.fp16sr.round_stochastic", line): LOW_16 for line in (
        "return torch.where(bits > 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(torch.float16)",
        "return torch.where(bits >= 1 >> 15, bits - (1 << 16), bits).to(torch.int16).view(torch.float16)",
        "return torch.where(bits >= 2 << 15, bits - (1 << 16), bits).to(torch.int16).view(torch.float16)",
        "return torch.where(bits >= 1 << 16, bits - (1 << 16), bits).to(torch.int16).view(torch.float16)",
        "return torch.where(bits >= 1 << 15, bits + (1 << 16), bits).to(torch.int16).view(torch.float16)",
        "return torch.where(bits >= 1 << 15, bits - (1 >> 16), bits).to(torch.int16).view(torch.float16)",
        "return torch.where(bits >= 1 << 15, bits - (2 << 16), bits).to(torch.int16).view(torch.float16)",
        "return torch.where(bits >= 1 << 15, bits - (1 << 17), bits).to(torch.int16).view(torch.float16)",
    )},
    ("fp4kit.formats.fp16sr.round_stochastic", "h = torch.where(mag > 0x7F800000, FP16_QNAN, torch.where(mag == 2139095041, FP16_INF, h))"):
        "Inf reaches 0x7C00 through the overflow clamp as well (its re-biased exponent is far past fp16's)",
    # conformance._path_match: `f".{entry}." in f".{name}."` alone decides; the equality and the
    # prefix test are special cases of it, and trailing (or leading) dots of the name never change it
    ("fp4kit.export.conformance._path_match", 'return entry == name or name.startswith(entry + "XX.XX") or f".{entry}." in f".{name}."'): PATH_MATCH,
    ("fp4kit.export.conformance._path_match", 'return entry == name and name.startswith(entry + ".") or f".{entry}." in f".{name}."'): PATH_MATCH,
    ("fp4kit.export.conformance._path_match", 'entry, name = entry.rstrip("."), name.rstrip(None)'): PATH_MATCH,
    ("fp4kit.export.conformance._path_match", 'entry, name = entry.rstrip("."), name.lstrip(".")'): PATH_MATCH,
    ("fp4kit.export.conformance._path_match", 'entry, name = entry.rstrip("."), name.rstrip("XX.XX")'): PATH_MATCH,
    ("fp4kit.export.conformance._path_match", 'entry, name = entry.rstrip("XX.XX"), name.rstrip(".")'):
        "also strips a trailing capital X: module paths in ignore lists are lowercase attribute names",
    # verify.tensor_parallel
    ("fp4kit.verify.tensor_parallel", "attention = None"): "None and False are both false, and `attention` is only tested",
    ("fp4kit.verify.tensor_parallel", "elif packed and (k / tp) % NVFP4_BLOCK_SIZE:"):
        "reached only where tp divides K: k / tp is the same whole number as k // tp",
    # VerifyReport.text: the tensor-parallel Checks made here are only printed, by tensor and detail
    ("fp4kit.verify.VerifyReport.text", 'bad = [Check(None, False, "", reason) for reason in tp["problems"]]'): TP_CHECKS,
    ("fp4kit.verify.VerifyReport.text", 'bad = [Check(name, None, "", reason) for reason in tp["problems"]]'): TP_CHECKS,
    # fp16sr.round_stochastic: `sub` is used only for 90 <= e <= 112, where 113 - e is 1..23
    ("fp4kit.formats.fp16sr.round_stochastic", "shift = (113 - e).clamp(min=None, max=31)"): SUB_ONLY,
    ("fp4kit.formats.fp16sr.round_stochastic", "shift = (113 - e).clamp(min=0, max=None)"): SUB_ONLY,
    ("fp4kit.formats.fp16sr.round_stochastic", "shift = (113 - e).clamp(max=31)"): SUB_ONLY,
    ("fp4kit.formats.fp16sr.round_stochastic", "shift = (113 - e).clamp(min=0, )"): SUB_ONLY,
    ("fp4kit.formats.fp16sr.round_stochastic", "shift = (113 - e).clamp(min=1, max=31)"): SUB_ONLY,
    ("fp4kit.formats.fp16sr.round_stochastic", "shift = (113 - e).clamp(min=0, max=32)"): SUB_ONLY,
    ("fp4kit.formats.fp16sr.round_stochastic", "sub = ((mag & 0x7FFFFF) | 8388609) >> shift"):
        "the extra bit 0 is shifted out: `sub` is used only with a shift of 1..23",
    ("fp4kit.formats.fp16sr.round_stochastic", "s = torch.where(e > 113, normal, torch.where(e >= 90, sub, torch.zeros_like(mag)))"):
        E_113,
    ("fp4kit.formats.fp16sr.round_stochastic", "s = torch.where(e >= 114, normal, torch.where(e >= 90, sub, torch.zeros_like(mag)))"):
        E_113,
    ("fp4kit.formats.fp16sr.round_stochastic", "a = x.view(torch.int32).to(None) & MASK32"):
        "kept as int32, a negative x's bits stay negative: the sign shifts in as -1 << 15 and the int16 view "
        "of sign | h is the same 16 bits",
    ("fp4kit.formats.fp16sr.round_stochastic", "r = torch.as_tensor(rand, device=x.device).to(None) & ((1 << RANDOM_BITS) - 1)"):
        "an integer tensor's low 13 bits are the same in its own dtype, and s + r promotes to int64",
    # fp16sr.random_bits
    ("fp4kit.formats.fp16sr.random_bits", "o = torch.arange(offset, offset + n, dtype=None, device=device)"): ARANGE_INT64,
    ("fp4kit.formats.fp16sr.random_bits", "o = torch.arange(offset, offset + n, device=device)"): ARANGE_INT64,
    ("fp4kit.formats.fp16sr.random_bits", "counter = torch.stack([base & MASK32, base >> 32, torch.zeros_like(base), torch.zeros_like(base)], dim=+1)"):
        ONE_D,
    ("fp4kit.formats.fp16sr.random_bits", "key = torch.tensor([seed & MASK32, seed >> 32], dtype=None, device=device)"):
        "torch.tensor of Python integers is int64",
    ("fp4kit.formats.fp16sr.random_bits", "key = torch.tensor([seed & MASK32, seed >> 32], device=device)"):
        "torch.tensor of Python integers is int64",
    ("fp4kit.formats.fp16sr.random_bits", "key = torch.tensor([seed & MASK32, seed >> 32], dtype=torch.int64, device=None)"):
        PHILOX_MOVES_KEY,
    ("fp4kit.formats.fp16sr.random_bits", "key = torch.tensor([seed & MASK32, seed >> 32], dtype=torch.int64, )"): PHILOX_MOVES_KEY,
    ("fp4kit.formats.fp16sr.random_bits", "return words.gather(+1, (o % 4).unsqueeze(-1)).squeeze(-1).reshape(tuple(shape)) & ((1 << RANDOM_BITS) - 1)"):
        ONE_D,
    ("fp4kit.formats.fp16sr.random_bits", "return words.gather(-1, (o % 4).unsqueeze(+1)).squeeze(-1).reshape(tuple(shape)) & ((1 << RANDOM_BITS) - 1)"):
        ONE_D,
    ("fp4kit.formats.fp16sr.random_bits", "return words.gather(-1, (o % 4).unsqueeze(-1)).squeeze(+1).reshape(tuple(shape)) & ((1 << RANDOM_BITS) - 1)"):
        ONE_D,
    ("fp4kit.formats.fp16sr.random_bits", "return words.gather(-1, (o % 4).unsqueeze(-1)).squeeze(-2).reshape(tuple(shape)) & ((1 << RANDOM_BITS) - 1)"):
        "squeeze(-2) of [n, 1] drops a dimension only for n = 1, and the reshape to `shape` follows either way",
    # fp16sr.round_state
    ("fp4kit.formats.fp16sr.round_state", "return round_stochastic(x, random_bits(x.shape, seed, rounds, offset, device=None))"): BITS_MOVED,
    ("fp4kit.formats.fp16sr.round_state", "return round_stochastic(x, random_bits(x.shape, seed, rounds, offset, ))"): BITS_MOVED,
    # philox
    ("fp4kit.formats.philox.philox4x32", "device = None"): KEEPS_DEVICE,
    ("fp4kit.formats.philox.philox4x32", "device = counter.device if (isinstance(counter, torch.Tensor)) and False else None"): KEEPS_DEVICE,
    ("fp4kit.formats.philox.philox4x32", 'c = _word(counter, "counter", None)'): KEEPS_DEVICE,
    # e4m3.encode
    ("fp4kit.formats.e4m3.encode", "normal = r > E4M3_MIN_NORMAL"):
        "at r = 2^-6 the subnormal formula r / 2^-9 gives 8 = 0x08, the code of 2^-6 itself",
    ("fp4kit.formats.e4m3.encode", "man = ((2.0 * mant - 1.0) * 9.0).to(torch.int32)"):
        "2 * mant - 1 is k/8 (k = 0..7): 9k/8 truncates to k, as 8k/8 does",
    ("fp4kit.formats.e4m3.encode", "code = code | (torch.signbit(x).to(None) << 7)"):
        "a bool tensor shifted by 7 is promoted to an integer tensor: the same sign bit",
    # e2m1.encode
    ("fp4kit.formats.e2m1.encode", "bounds = torch.tensor(E2M1_MIDPOINTS, dtype=None, device=x.device)"):
        "the midpoints are exact in fp32 and in every input dtype: the comparisons do not change",
    ("fp4kit.formats.e2m1.encode", "bounds = torch.tensor(E2M1_MIDPOINTS, device=x.device)"):
        "the midpoints are exact in fp32 and in every input dtype: the comparisons do not change",
    ("fp4kit.formats.e2m1.encode", "index = torch.bucketize(a, bounds, ).to(torch.uint8)"):
        "right=False is bucketize's default",
    ("fp4kit.formats.e2m1.encode", "index += (a == tie).to(None)"):
        "adding a bool tensor in place to a uint8 one adds 0 or 1",
    # fp8
    ("fp4kit.formats.fp8.search_amax", 'if not mults or not all(c > 0 and c == c and c != float("INF") for c in mults):'):
        'float() reads "INF" as infinity too',
    ("fp4kit.formats.fp8.fake_quant_modelopt", "return e4m3.decode(e4m3.encode((x.float() * scale).clamp(None, FP8_MAX))) * (1.0 / scale)"):
        "redundant clamp: e4m3.encode saturates at -448 itself",
    ("fp4kit.formats.fp8.fake_quant_modelopt", "return e4m3.decode(e4m3.encode((x.float() * scale).clamp(-FP8_MAX, None))) * (1.0 / scale)"):
        "redundant clamp: e4m3.encode saturates at +448 itself",
    ("fp4kit.formats.fp8.fake_quant_modelopt", "return e4m3.decode(e4m3.encode((x.float() * scale).clamp(-FP8_MAX, ))) * (1.0 / scale)"):
        "redundant clamp: e4m3.encode saturates at +448 itself",
    # arith.div_const
    ("fp4kit.formats.arith.div_const", "return x * torch.full((), fp32_reciprocal(c), dtype=None, device=x.device)"): FP32_DEFAULT,
    ("fp4kit.formats.arith.div_const", "return x * torch.full((), fp32_reciprocal(c), device=x.device)"): FP32_DEFAULT,
    ("fp4kit.formats.arith.div_const", "return x * torch.full((), fp32_reciprocal(c), dtype=torch.float32, device=None)"): CPU_SCALAR,
    ("fp4kit.formats.arith.div_const", "return x * torch.full((), fp32_reciprocal(c), dtype=torch.float32, )"): CPU_SCALAR,
    ("fp4kit.formats.arith.div_const", "return x / torch.full((), c, dtype=None, device=x.device)"): FP32_DEFAULT,
    ("fp4kit.formats.arith.div_const", "return x / torch.full((), c, device=x.device)"): FP32_DEFAULT,
    # nvfp4
    ("fp4kit.formats.nvfp4._cast_block_scale", "return e4m3.cast(s.clamp(min=BLOCK_SCALE_MIN, max=None))"):
        "redundant clamp: e4m3.cast saturates at 448 itself",
    ("fp4kit.formats.nvfp4._cast_block_scale", "return e4m3.cast(s.clamp(min=BLOCK_SCALE_MIN, ))"):
        "redundant clamp: e4m3.cast saturates at 448 itself",
    ("fp4kit.formats.nvfp4._assemble", "one = e4m3.cast(torch.ones((), device=None))"): CPU_SCALAR,
    ("fp4kit.formats.nvfp4._assemble", "one = e4m3.cast(torch.ones((), ))"): CPU_SCALAR,
    ("fp4kit.formats.nvfp4._importance_weights", "if w.dim() > 2:"):
        "redundant test: importance of a 2-D weight is [K], and its [K/16, 16] broadcasts alike with or without the N axis",
    ("fp4kit.formats.nvfp4._importance_weights", "if w.dim() >= 3:"):
        "redundant test: importance of a 2-D weight is [K], and its [K/16, 16] broadcasts alike with or without the N axis",
    ("fp4kit.formats.nvfp4._quantize", "global_scale = global_scale_of(g_safe, None, arith)"):
        "global_scale_of treats every rule but \"6\" as \"4o6\"",
    ("fp4kit.formats.nvfp4._quantize", 'global_scale = global_scale_of(g_safe, "XX4o6XX", arith)'):
        "global_scale_of treats every rule but \"6\" as \"4o6\"",
    ("fp4kit.formats.nvfp4._quantize", 'global_scale = global_scale_of(g_safe, "4O6", arith)'):
        "global_scale_of treats every rule but \"6\" as \"4o6\"",
    # export/modelopt.py
    ("fp4kit.export.modelopt._excluded_module_names",
     "names.append(qm.adapter.disk_name(p.target.name) if (p.target.is_stack) or True else p.target.disk_names[0])"):
        "redundant test: a target that is not a stack has disk_names == [adapter.disk_name(name)]",
    ("fp4kit.export.modelopt._write_tensors",
     'tied = ptr is not None and ptr in seen_storage and getattr(qm.model.config, "tie_word_embeddings", None)'):
        "None and False are both false",
    # verify.py: ModelOpt's own FP8 calibration of a Linear holding w (weight quantizer only, no forward pass)
    ("fp4kit.verify._modelopt_fp8", "linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=True, device=w.device, dtype=w.dtype)"): NO_BIAS,
    ("fp4kit.verify._modelopt_fp8", "linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=None, device=w.device, dtype=w.dtype)"): NO_BIAS,
    ("fp4kit.verify._modelopt_fp8", "linear = torch.nn.Linear(w.shape[1], w.shape[0], device=w.device, dtype=w.dtype)"): NO_BIAS,
    ("fp4kit.verify._modelopt_fp8", '{"quantizer_name": "XX*XX", "enable": False},'): ONLY_WEIGHT_QUANTIZER,
    ("fp4kit.verify._modelopt_fp8", '{"quantizer_name": "*", "enable": True},'): ONLY_WEIGHT_QUANTIZER,
    ("fp4kit.verify._modelopt_fp8", "with contextlib.redirect_stdout(None), contextlib.redirect_stderr(io.StringIO()):"):
        "print() to a None sys.stdout writes nothing, as to the discarded StringIO: only ModelOpt's log lines change place",
    ("fp4kit.verify._modelopt_fp8", "mtq.quantize(linear, cfg, )"): "forward_loop=None is mtq.quantize's default",
    ("fp4kit.verify._modelopt_fp8", "scale = get_weight_scaling_factor(linear, ).float().reshape(())  # stored 0-d, as ModelOpt's export writes it"):
        'weight_name="weight" is get_weight_scaling_factor\'s default',
    ("fp4kit.verify.against_modelopt", "model, _ = load_model(source, device=device, tokenizer=None)"): NO_TOKENIZER,
    ("fp4kit.verify.rederive", "model, _ = load_model(source, device=device, tokenizer=None)"): NO_TOKENIZER,
    ("fp4kit.verify.against_modelopt", 'quantizer = SimpleNamespace(global_amax=w.abs().amax().float(), _amax=(blocks * mult).reshape(-1, ),'): AMAX_VIEW,
    ("fp4kit.verify.against_modelopt", 'quantizer = SimpleNamespace(global_amax=w.abs().amax().float(), _amax=(blocks * mult).reshape(-1, 2),'): AMAX_VIEW,
    ("fp4kit.verify.against_modelopt", 'block_sizes={-1: 16, "XXtypeXX": "static", "scale_bits": (4, 3), "four_over_six": True})'): UNREAD_BLOCK_SIZES,
    ("fp4kit.verify.against_modelopt", 'block_sizes={-1: 16, "TYPE": "static", "scale_bits": (4, 3), "four_over_six": True})'): UNREAD_BLOCK_SIZES,
    ("fp4kit.verify.against_modelopt", 'block_sizes={-1: 16, "type": "XXstaticXX", "scale_bits": (4, 3), "four_over_six": True})'): UNREAD_BLOCK_SIZES,
    ("fp4kit.verify.against_modelopt", 'block_sizes={-1: 16, "type": "STATIC", "scale_bits": (4, 3), "four_over_six": True})'): UNREAD_BLOCK_SIZES,
    ("fp4kit.verify.against_modelopt", 'block_sizes={-1: 16, "type": "static", "XXscale_bitsXX": (4, 3), "four_over_six": True})'): UNREAD_BLOCK_SIZES,
    ("fp4kit.verify.against_modelopt", 'block_sizes={-1: 16, "type": "static", "SCALE_BITS": (4, 3), "four_over_six": True})'): UNREAD_BLOCK_SIZES,
    ("fp4kit.verify.against_modelopt", 'block_sizes={-1: 16, "type": "static", "scale_bits": (5, 3), "four_over_six": True})'): UNREAD_BLOCK_SIZES,
    ("fp4kit.verify.against_modelopt", 'block_sizes={-1: 16, "type": "static", "scale_bits": (4, 4), "four_over_six": True})'): UNREAD_BLOCK_SIZES,
    ("fp4kit.verify.against_modelopt", 'scale, _ = NVFP4QTensor.get_weights_scaling_factor_from_quantizer(quantizer, w, None)'): SCALE2_DEFAULT,
    ("fp4kit.verify.against_modelopt", 'scale, _ = NVFP4QTensor.get_weights_scaling_factor_from_quantizer(quantizer, w, )'): SCALE2_DEFAULT,
    # verify.modelopt_mse_algorithm (reached only with two or more multipliers)
    ("fp4kit.verify.modelopt_mse_algorithm", "steps = math.ceil((stop - start) / step) + 1 if step > 0 else 1"):
        "with step <= 0 both 0 and 1 are fewer than the two or more multipliers: the grid is [] either way and the list is refused",
    ("fp4kit.verify.modelopt_mse_algorithm", "grid = torch.linspace(start, stop, steps=max(steps, 1)).tolist() if (steps == len(amax_search)) or True else []"):
        "where steps != len(amax_search) the grid has max(steps, 1) values, not len(amax_search): it differs from the list as [] does",
    ("fp4kit.verify.modelopt_mse_algorithm", "grid = torch.linspace(start, stop, steps=max(steps, 2)).tolist() if steps == len(amax_search) else []"):
        "max(steps, 2) differs from max(steps, 1) only for steps <= 1, and then steps != len(amax_search) (two or more)",
}
# (function, mutated line) of the survivors that put a tensor on the CPU where the input's device
# was meant: on the CPU nothing changes, on CUDA the op mixes devices or divides by a CPU scalar.
CUDA_ONLY = {
    ("fp4kit.formats.e2m1.encode", "bounds = torch.tensor(E2M1_MIDPOINTS, dtype=x.dtype, device=None)"),
    ("fp4kit.formats.e2m1.encode", "bounds = torch.tensor(E2M1_MIDPOINTS, dtype=x.dtype, )"),
    ("fp4kit.formats.e2m1.decode", "return _value_table(None)[codes.long()]"),
    ("fp4kit.formats.arith.div_const", "return x / torch.full((), c, dtype=torch.float32, device=None)"),
    ("fp4kit.formats.arith.div_const", "return x / torch.full((), c, dtype=torch.float32, )"),
    ("fp4kit.formats.nvfp4._resolve_global_amax", "g = torch.as_tensor(global_amax, dtype=torch.float32, device=None)"),
    ("fp4kit.formats.nvfp4._resolve_global_amax", "g = torch.as_tensor(global_amax, dtype=torch.float32, )"),
    ("fp4kit.formats.nvfp4._importance_weights", "imp = torch.as_tensor(importance, device=None).float()"),
    ("fp4kit.formats.nvfp4._importance_weights", "imp = torch.as_tensor(importance, ).float()"),
    ("fp4kit.formats.nvfp4.quantize_static", "g = torch.as_tensor(global_amax, dtype=torch.float32, device=None)"),
    ("fp4kit.formats.nvfp4.quantize_static", "g = torch.as_tensor(global_amax, dtype=torch.float32, )"),
    # the model, a weight or a stored scale left on the CPU where `device` (the source model's) or
    # ModelOpt's device (CUDA for a checkpoint in CUDA's arithmetic) was asked for
    ("fp4kit.verify.against_modelopt", "model, _ = load_model(source, device=None, tokenizer=False)"),
    ("fp4kit.verify.against_modelopt", "w = (t.weight.detach()[0] if t.is_stack else t.weight.detach()).to(None)"),
    ("fp4kit.verify.against_modelopt", 'chose4 = four_over_six_from_weight(w, rule, reader.get(f"{disk}.weight_scale").to(None), arith)'),
    ("fp4kit.verify.rederive", "model, _ = load_model(source, device=None, tokenizer=False)"),
    # ModelOpt's FP8 calibration on a Linear made on the CPU for a CUDA weight
    ("fp4kit.verify._modelopt_fp8", "linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=None, dtype=w.dtype)"),
    ("fp4kit.verify._modelopt_fp8", "linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)"),
    # philox: a batched key on the CPU for counters on CUDA (a single key unbinds into 0-d scalars,
    # which any device takes)
    ("fp4kit.formats.philox._word", "t = torch.as_tensor(x, device=None)"),
    ("fp4kit.formats.philox._word", "t = torch.as_tensor(x, )"),
    ("fp4kit.formats.philox.philox4x32", 'k = _word(key, "key", None)'),
    # fp16sr: random bits on the CPU for a state on CUDA
    ("fp4kit.formats.fp16sr.round_stochastic", "r = torch.as_tensor(rand, device=None).to(torch.int64) & ((1 << RANDOM_BITS) - 1)"),
    ("fp4kit.formats.fp16sr.round_stochastic", "r = torch.as_tensor(rand, ).to(torch.int64) & ((1 << RANDOM_BITS) - 1)"),
    ("fp4kit.formats.fp16sr.random_bits", "o = torch.arange(offset, offset + n, dtype=torch.int64, device=None)"),
    ("fp4kit.formats.fp16sr.random_bits", "o = torch.arange(offset, offset + n, dtype=torch.int64, )"),
    # verify: ModelOpt run on the CPU for a --device cuda run (a checkpoint in CUDA's arithmetic is then refused)
    ("fp4kit.verify.verify", "against_modelopt(report, folder, source, device=None)"),
    ("fp4kit.verify.verify", "against_modelopt(report, folder, source, )"),
}


def mutated_files() -> list[Path]:
    """The files [tool.mutmut] mutates, as mutmut itself walks them (run from the repository)."""
    from mutmut.utils.file_utils import walk_mutatable_files

    return sorted(walk_mutatable_files())


def survivors_of(paths: list[str]) -> list[str]:
    """The mutants of these files that survived their last test run."""
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.stats import status_by_exit_code

    names = []
    for path in paths:
        data = SourceFileMutationData(path=Path(path))
        data.load()
        names += sorted(m for m, code in data.exit_code_by_key.items() if status_by_exit_code[code] == "survived")
    return names


def forget_plain_copies() -> None:
    """mutmut copies a file it does not mutate into mutants/ with a newer mtime, and later takes
    that copy for an up-to-date mutated file: a file added to only_mutate would never be
    mutated. Remove the copy of every file to mutate that has no mutation data yet."""
    for path in mutated_files():
        copy = REPO / "mutants" / path
        if copy.is_file() and not (REPO / "mutants" / f"{path}.meta").is_file():
            copy.unlink()


def run_mutmut(globs: list[str], max_children: int, restarts: int = 3) -> int:
    """Run mutmut; where a signal ends it, run it again (it keeps every result it has, and a
    plain `mutmut run` tests only the mutants left unchecked). Returns the restarts made."""
    forget_plain_copies()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one torch thread per mutant process
    cmd = [str(Path(sys.executable).with_name("mutmut")), "run", "--max-children", str(max_children), *globs]
    for attempt in range(restarts + 1):
        code = subprocess.run(cmd, cwd=REPO, env=env).returncode
        if code == 0:
            return attempt
        if code > 0 or attempt == restarts:
            raise SystemExit(f"mutmut run ended with {code}")
        print(f"mutmut run was ended by signal {-code}; running it again for the unchecked mutants", flush=True)
        cmd = cmd[: cmd.index("--max-children") + 2]
    return restarts


def mutated_line(diff: str) -> str:
    added = [line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    return added[0] if len(added) == 1 else " / ".join(added)


def function_of(mutant: str) -> str:
    module, _, name = mutant.rpartition(".")
    name = name.rpartition("__mutmut_")[0]
    name = name[2:] if name.startswith("x_") else name.replace("xǁ", "").replace("ǁ", ".")
    return f"{module}.{name}"


def judge(mutant: str, status: str, line: str) -> dict:
    """A survivor's (or other undetected mutant's) entry: equivalent, CUDA-only or unexplained."""
    key = (function_of(mutant), line)
    entry = {"mutant": mutant, "status": status, "mutated_line": line}
    if status == "survived" and key in EQUIVALENT:
        entry["equivalent"] = EQUIVALENT[key]
    elif status == "survived" and key in CUDA_ONLY:
        entry["cuda_only"] = True
    else:
        entry["unexplained"] = True
    return entry


def file_row(counts: Counter, entries: list[dict], measured: str) -> dict:
    total = sum(counts.values())
    detected = counts["killed"] + counts["timeout"]
    equivalent = sum("equivalent" in e for e in entries)
    cuda_only = sum("cuda_only" in e for e in entries)
    undecidable = equivalent + cuda_only
    return {
        "total": total, "killed": counts["killed"], "timeout": counts["timeout"],
        "survived": counts["survived"], "no_tests": counts["no tests"],
        "not_checked": counts["not checked"], "other": total - sum(counts[s] for s in (
            "killed", "timeout", "survived", "no tests", "not checked")),
        "equivalent": equivalent, "cuda_only": cuda_only,
        "score": round(detected / (total - undecidable), 4) if total > undecidable else None,
        # over the mutants tested so far (equal to score once none is left unchecked)
        "score_checked": (round(detected / (total - counts["not checked"] - undecidable), 4)
                          if total - counts["not checked"] > undecidable else None),
        "measured": measured,
    }


def report(previous: dict, date: str, ran: set[str] | None) -> tuple[dict, list[dict]]:
    """Per file the counts and survivors in mutants/ (or, where mutants/ holds none, the previous
    JSON's). `ran`: the files this invocation tested (None: all of them); a file it did not test
    keeps the date of its previous entry while its counts are unchanged."""
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.mutation.diff_apply import get_diff_for_mutant
    from mutmut.stats import status_by_exit_code

    files, survivors = {}, []
    for path in mutated_files():
        data = SourceFileMutationData(path=path)
        data.load()
        counts = Counter(status_by_exit_code[code] for code in data.exit_code_by_key.values())
        old = previous.get("files", {}).get(str(path))
        if counts and counts["not checked"] == sum(counts.values()) and old and not old["not_checked"]:
            # no result in mutants/ (mutmut reset them): keep the last full measurement of the file
            entries = [judge(e["mutant"], e["status"], e["mutated_line"]) for e in previous.get("survivors", [])
                       if e["mutant"].startswith(path.with_suffix("").as_posix().replace("/", ".") + ".")]
            old_counts = Counter({"killed": old["killed"], "timeout": old["timeout"], "survived": old["survived"],
                                  "no tests": old["no_tests"]})
            old_counts["other"] = old["other"]
            files[str(path)] = file_row(old_counts, entries, old.get("measured", previous.get("date")))
            survivors += entries
            continue
        entries = []
        for mutant, code in sorted(data.exit_code_by_key.items()):
            status = status_by_exit_code[code]
            if status in ("killed", "timeout", "not checked"):
                continue
            entries.append(judge(mutant, status, mutated_line(get_diff_for_mutant(mutant, path=path))))
        row = file_row(counts, entries, date)
        same = old and all(old[k] == row[k] for k in ("total", "killed", "timeout", "survived", "no_tests", "not_checked"))
        if same and ran is not None and str(path) not in ran:
            row["measured"] = old.get("measured", previous.get("date"))
        files[str(path)] = row
        survivors += entries
    return files, survivors


def group_scores(files: dict) -> dict:
    groups = {"fp4kit/formats/": lambda p: p.startswith("fp4kit/formats/"),
              "fp4kit/export/modelopt.py": lambda p: p == "fp4kit/export/modelopt.py",
              "fp4kit/export/conformance.py": lambda p: p == "fp4kit/export/conformance.py",
              "fp4kit/verify.py": lambda p: p == "fp4kit/verify.py",
              "all": lambda p: True}
    out = {}
    for name, member in groups.items():
        rows = [r for p, r in files.items() if member(p)]
        total = sum(r["total"] for r in rows)
        detected = sum(r["killed"] + r["timeout"] for r in rows)
        equivalent = sum(r["equivalent"] for r in rows)
        cuda_only = sum(r["cuda_only"] for r in rows)
        left = total - equivalent - cuda_only
        unchecked = sum(r["not_checked"] for r in rows)
        out[name] = {"total": total, "detected": detected, "equivalent": equivalent, "cuda_only": cuda_only,
                     "not_checked": unchecked,
                     "score": round(detected / left, 4) if left else None,
                     "score_checked": round(detected / (left - unchecked), 4) if left > unchecked else None,
                     "raw_score": round(detected / total, 4) if total else None}
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown_tables(out: dict) -> dict[str, str]:
    """The score, equivalent and CUDA-only tables of docs/mutation.md, from mutation.json."""
    score = ["| file | mutants | killed | timeout | survived | equivalent | CUDA-only | not checked "
             "| score | of those checked | raw score | measured |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for path, r in out["files"].items():
        if not r["total"]:
            continue
        raw = (r["killed"] + r["timeout"]) / r["total"]
        score.append(f"| `{path}` | {r['total']} | {r['killed']} | {r['timeout']} | {r['survived']} | {r['equivalent']} "
                     f"| {r['cuda_only']} | {r['not_checked']} | {_pct(r['score'])} | {_pct(r['score_checked'])} | {_pct(raw)} "
                     f"| {r['measured']} |")
    score += ["", "| group | mutants | detected | equivalent | CUDA-only | not checked | score | of those checked "
              "| raw score |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, g in out["groups"].items():
        label = "all four" if name == "all" else f"`{name}`"
        score.append(f"| {label} | {g['total']} | {g['detected']} | {g['equivalent']} | {g['cuda_only']} "
                     f"| {g['not_checked']} | **{_pct(g['score'])}** | {_pct(g['score_checked'])} | {_pct(g['raw_score'])} |")

    def where(mutant: str) -> str:
        return f"`{function_of(mutant).removeprefix('fp4kit.')}`"

    def code(line: str) -> str:
        return "`" + line.replace("|", "\\|").replace("`", "'") + "`"

    equivalent = ["| where | mutated line | why it is equivalent |", "|---|---|---|"]
    equivalent += [f"| {where(s['mutant'])} | {code(s['mutated_line'])} | {s['equivalent']} |"
                   for s in out["survivors"] if "equivalent" in s]
    cuda = ["| where | mutated line |", "|---|---|"]
    cuda += [f"| {where(s['mutant'])} | {code(s['mutated_line'])} |" for s in out["survivors"] if "cuda_only" in s]
    return {"score": "\n".join(score), "equivalent": "\n".join(equivalent), "cuda": "\n".join(cuda)}


def write_docs(out: dict, doc: Path) -> None:
    """Replace the text between `<!-- mutation:NAME -->` and `<!-- /mutation:NAME -->` in `doc`."""
    text = doc.read_text()
    for name, table in markdown_tables(out).items():
        begin, end = f"<!-- mutation:{name} -->", f"<!-- /mutation:{name} -->"
        if begin not in text or end not in text:
            raise SystemExit(f"{doc} lacks the markers {begin} ... {end}")
        head, rest = text.split(begin, 1)
        text = head + begin + "\n" + table + "\n" + end + rest.split(end, 1)[1]
    doc.write_text(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="*", help="files whose mutants to retest (default: a full run from scratch)")
    p.add_argument("--report-only", action="store_true", help="run nothing; read mutants/")
    p.add_argument("--resume", action="store_true", help="test the mutants an interrupted run left unchecked")
    p.add_argument("--survivors", action="store_true",
                   help="retest only the surviving mutants of the files given (of every file if none)")
    p.add_argument("--docs", type=Path, default=REPO / "docs" / "mutation.md",
                   help="the document whose score and survivor tables to rewrite")
    p.add_argument("--max-children", type=int, default=2)
    p.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results" / "mutation.json")
    args = p.parse_args()
    os.chdir(REPO)

    wall = restarts = None
    if not args.report_only:
        if args.survivors:
            globs = survivors_of(args.paths or [str(p) for p in mutated_files()])
            if not globs:
                raise SystemExit("no surviving mutants to retest")
        elif args.paths:
            globs = [Path(x).with_suffix("").as_posix().replace("/", ".") + ".*" for x in args.paths]
        elif args.resume:
            globs = []
        else:
            shutil.rmtree(REPO / "mutants", ignore_errors=True)
            globs = []
        t0 = time.perf_counter()
        restarts = run_mutmut(globs, args.max_children)
        wall = round(time.perf_counter() - t0, 1)

    previous = json.loads(args.results.read_text()) if args.results.is_file() else {}
    record = run_record()
    ran = None if args.report_only or not (args.paths or args.survivors) else (
        {str(p) for p in mutated_files()} if not args.paths else {Path(x).as_posix() for x in args.paths})
    if args.report_only:
        ran = set()
    files, survivors = report(previous, record["date"], ran)
    record["versions"]["mutmut"] = importlib.metadata.version("mutmut")
    out = {
        **record,
        "mutmut_config": "pyproject.toml [tool.mutmut]",
        "machine": f"{os.cpu_count()} CPU cores, --max-children {args.max_children}",
        "wall_s": wall,
        "restarts": restarts,
        "score": ("(killed + timeout) / (total - equivalent - cuda_only); score_checked: the same without the "
                  "mutants not checked yet; raw_score: (killed + timeout) / total"),
        "groups": group_scores(files),
        "files": files,
        "survivors": survivors,
    }
    args.results.write_text(json.dumps(out, indent=2, ensure_ascii=False) + "\n")
    write_docs(out, args.docs)
    unexplained = [s["mutant"] for s in survivors if s.get("unexplained")]
    for name, g in out["groups"].items():
        print(f"{name}: {g['detected']} of {g['total']} detected, {g['equivalent']} equivalent, "
              f"{g['cuda_only']} CUDA-only, {g['not_checked']} not checked: score {g['score']}, "
              f"of those checked {g['score_checked']}, raw {g['raw_score']}")
    if unexplained:
        print(f"{len(unexplained)} surviving mutants are not named in EQUIVALENT:")
        print("\n".join(f"  {m}" for m in unexplained))
        sys.exit(1)


if __name__ == "__main__":
    main()
