"""``python -m benchmarks``: every benchmark of the suite, one table each."""

from benchmarks import bench_exporters, bench_wrapper

bench_wrapper.main([])
print()
bench_exporters.main([])
