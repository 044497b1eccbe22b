"""``python -m hvd_qsgd``: what this installation can do (``hvd_qsgd.install_check``)."""
import sys

from hvd_qsgd.install_check import main

sys.exit(main())
