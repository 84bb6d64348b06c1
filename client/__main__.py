"""`python -m client`: see client/cli.py."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from client.cli import main

sys.exit(main())
