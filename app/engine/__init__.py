"""The engine: models, buffer pools, scheduler and dispatcher threads, behind a task-agnostic
message protocol (`protocol.py`). It runs in its own process (`process.py`, supervised by
`supervisor.py`) or, for tests and debugging, inside the front end (`inprocess.py`)."""
