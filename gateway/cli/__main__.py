"""`python -m gateway.cli`: the `toolkv` command."""

import sys

from gateway.cli.main import main

sys.exit(main())
