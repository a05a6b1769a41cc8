"""`python -m megatron_jreg.train` (or under torchrun): pretrain with or without JREG."""

import sys

from megatron_jreg.training.trainer import main

if __name__ == "__main__":
    sys.exit(main())
