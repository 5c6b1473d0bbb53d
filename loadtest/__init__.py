"""steadyserve's load-testing kit: an open-loop generator with SLA verdicts and plots,
plus locust and hey scenarios and the comparison bench (see loadtest/README.md)."""
