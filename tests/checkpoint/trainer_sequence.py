"""Several trainer runs one after another in one world, under torchrun: each command line
of the JSON list in argv[1] goes through the trainer's own entry point
(``commands.train.main``, ``trainer.run``), with the process group and megatron's groups
kept between runs (``run`` tears them down after each otherwise), so the imports and the
world's start are paid once instead of once per run. Prints ``RUN i EXIT code`` per run
on rank 0; exits 1 when a run did not exit 0."""

import json
import sys

from megatron_jreg.commands import train as command
from megatron_jreg.training import trainer

if __name__ == "__main__":
    teardown = trainer.teardown
    trainer.teardown = lambda: None  # until the last run is done
    with open(sys.argv[1]) as f:
        runs = json.load(f)
    codes = []
    for i, argv in enumerate(runs):
        codes.append(command.main(argv))
        print(f"RUN {i} EXIT {codes[-1]}", flush=True)
    teardown()
    sys.exit(0 if not any(codes) else 1)
