"""``python -m chatkit.server --model ...`` (the same as ``chatkit serve``, whose flags live in chatkit/cli/serve.py)."""

import sys

from ..cli.serve import main

sys.exit(main())
