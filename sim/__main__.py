"""python -m sim: run the vLLM-compatible simulator (same as ``kvgate sim``)."""

from sim.cli import main

raise SystemExit(main())
