"""``python -m tnt_snapshot_plugin``: the demo command (``tnt-snapshot-demo``)."""

import sys

from tnt_snapshot_plugin.demo import main

if __name__ == "__main__":
    sys.exit(main())
