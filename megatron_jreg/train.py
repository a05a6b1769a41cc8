"""`python -m megatron_jreg.train` (or under torchrun): ``megatron_jreg.commands.train``."""

import sys

from megatron_jreg.commands.train import main

if __name__ == "__main__":
    sys.exit(main())
