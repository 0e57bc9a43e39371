"""python -m llmz.bench: llmz/bench/__init__.py's main."""
import sys

from . import main

sys.exit(main())
