"""Probes of the process's surroundings (docs/SPIKES.md): cgroup quota and throttling, event
loop lag, GC pauses, CPU time, first-seen shapes, CUDA allocator and context, NVML.

Every probe answers `read()` with cumulative counters (keys ending in `_total`, whose change
over a request is what counts) and current levels (anything else); `probe.py` holds that
interface, the set of probes of one process and a fake for tests.
"""
