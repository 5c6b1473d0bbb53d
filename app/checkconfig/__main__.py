"""`python -m app.checkconfig`: the same as `steadyserve check-config`."""

from app.checkconfig.compare import main

raise SystemExit(main())
