"""python -m extproc: the same command as ``kvgate``."""

import sys

from extproc.cli import main

if __name__ == "__main__":
    sys.exit(main())
