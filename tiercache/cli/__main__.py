"""``python -m tiercache.cli``: the ``tiercache`` command without its console script."""

import sys

from tiercache.cli.app import main

sys.exit(main())
