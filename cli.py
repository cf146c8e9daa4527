"""`python cli.py fit --config configs/tiny.yaml`: the `meshtrain` command, run from a checkout."""

import sys

from meshtrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
