"""`python -m tileinfer`: the same command line as `tileinfer`."""
import sys

from tileinfer.cli import main

sys.exit(main())
