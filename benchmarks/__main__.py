from benchmarks.bench_wrapper import main

main()
