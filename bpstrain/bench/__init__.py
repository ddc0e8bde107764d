"""Benchmarks: bpstrain push_pull vs gloo all-reduce, on loopback or emulated hosts.

Run ``python -m bpstrain.bench`` (loopback) or ``python -m bpstrain.bench cluster ...``
(network namespaces with capped links; needs root). See ``bpstrain.bench.cli``.
"""
