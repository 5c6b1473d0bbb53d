"""steadyserve: an HTTP inference server that keeps tail latency flat."""

__version__ = "0.1.0"
