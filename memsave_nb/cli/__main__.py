"""``python -m memsave_nb.cli``: the same as ``memsave-nb``."""

import sys

from . import main

sys.exit(main())
