"""Slow-request reports: what a slow request went through and why it was slow
(docs/SPIKES.md). `attribution.py` is pure; `recorder.py` decides what is slow and keeps,
counts and logs the reports."""
