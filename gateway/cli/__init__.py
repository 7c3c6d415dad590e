"""The `toolkv` command line: `serve`, `config`, `bench`, `cache`, `parity`; how failures are reported.
"""

from gateway.cli.main import main

__all__ = ["main"]
