"""``python -m dflash_trt.cli``: the ``dflash-trt`` command."""

import sys

from . import main

sys.exit(main())
