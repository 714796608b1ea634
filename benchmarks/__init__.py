"""Throughput and MFU benchmarks (run as `python -m benchmarks.<name>`); not part of the tests."""
