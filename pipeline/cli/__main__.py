"""`python -m pipeline.cli`: the `edgeflux` command without its console script."""
import sys

from . import main

sys.exit(main())
