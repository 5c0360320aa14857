"""`python -m eqx_ensemble demo`: the deep-ensemble toy regression."""

import sys

from ._demo import main

if __name__ == "__main__":
    sys.exit(main())
