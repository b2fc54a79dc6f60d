"""`python -m infinity ...` (and `torchrun -m infinity train ...`): the `infinity` command."""

import sys

from .cli import main

sys.exit(main())
