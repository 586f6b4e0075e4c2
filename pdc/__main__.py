"""`python -m pdc ...` is `pdc ...`."""

from pdc.cli import main

raise SystemExit(main())
