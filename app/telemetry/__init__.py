"""Probes of the process's surroundings (cgroup quota, and later GPU, allocator, GC)."""
