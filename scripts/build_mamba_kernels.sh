#!/usr/bin/env bash
# Builds causal-conv1d and mamba-ssm wheels from their sdists for one GPU architecture only, with
# this machine's nvcc and torch: what benchmarks/results/*mamba-kernels* ran with. On a machine
# with a registry, `pip install --no-build-isolation mamba-ssm causal-conv1d` does the same for
# every architecture (several times longer); this is for an offline GPU machine (sdists carried
# in) and for a build that has to fit a time budget (sm_90 alone: 477 s on an H200 machine's
# 16 cores, both built side by side).
#
#   bash scripts/build_mamba_kernels.sh SDIST_DIR WHEEL_DIR [ARCH]     # ARCH: 90 (default), 100, ...
#   pip install --no-deps WHEEL_DIR/*.whl
#
# SDIST_DIR holds causal_conv1d-*.tar.gz and mamba_ssm-*.tar.gz (from pypi.org). Each setup.py
# names its CUDA targets one by one; every target but ARCH is dropped from a copy of it.
set -euo pipefail
sdists=$(realpath "$1"); wheels=$(realpath -m "$2"); arch=${3:-90}
work=$(mktemp -d)
mkdir -p "$wheels"
cd "$work"
for f in "$sdists"/causal_conv1d-*.tar.gz "$sdists"/mamba_ssm-*.tar.gz; do tar xzf "$f"; done
python3 - "$arch" <<'PY'
import glob, re, sys
arch = sys.argv[1]
for path in glob.glob("causal_conv1d-*/setup.py") + glob.glob("mamba_ssm-*/setup.py"):
    text = open(path).read()
    # `cc_flag.append("-gencode")` then `cc_flag.append("arch=compute_XX,code=sm_XX")`: the
    # second becomes a pop of the first for every XX but ARCH.
    text, dropped = re.subn(rf'cc_flag\.append\("arch=compute_(?!{arch},)\d+,code=sm_\d+"\)', "cc_flag.pop()", text)
    if f"arch=compute_{arch},code=sm_{arch}" not in text:
        sys.exit(f"{path}: no sm_{arch} target to keep")
    open(path, "w").write(text)
    print(f"{path}: {dropped} other targets dropped")
PY
export MAX_JOBS=${MAX_JOBS:-$(nproc)} TORCH_CUDA_ARCH_LIST="${arch:0:-1}.${arch: -1}"
export CAUSAL_CONV1D_FORCE_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE  # build here; never look for a prebuilt wheel online
start=$SECONDS
pids=()
for d in causal_conv1d-*/ mamba_ssm-*/; do
    (python3 -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$wheels" "./$d" \
        && echo "${d%/} built in $((SECONDS - start)) s") &
    pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
rm -rf "$work"
ls -l "$wheels"
