"""Performance benchmarks: benchmarks/README.md."""
