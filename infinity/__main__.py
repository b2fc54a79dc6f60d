"""`python -m infinity ...` (and `torchrun -m infinity train ...`): the `infinity` command."""

import sys

from infinity.job.cli import main

sys.exit(main())
