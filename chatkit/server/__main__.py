"""``python -m chatkit.server --model ...`` (the same as ``chatkit serve``)."""

import sys

from .run import main

sys.exit(main())
