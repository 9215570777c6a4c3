"""``python -m positronic_brain.cli``: the same as the ``positronic-brain`` command."""
import sys

from . import main

sys.exit(main())
