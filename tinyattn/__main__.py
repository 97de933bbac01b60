"""``python -m tinyattn``: see :mod:`tinyattn.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m tinyattn"))
