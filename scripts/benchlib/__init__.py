"""The GPU benchmarks of fp4kit's kernels that scripts/bench_kernels.py and scripts/bench_packed.py run,
and `record`: the date, command and versions every results file starts with."""
