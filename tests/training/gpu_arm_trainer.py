"""The trainer with its process-group setup in the GPU arm, tensors on the CPU platform.

Run as ``python gpu_arm_trainer.py TRAINER_FLAGS...`` (one process or under torchrun). The
default process group starts as on any CPU run (gloo, the CPU redirection), then
``megatron_jreg.distributed.setup`` is told that the device is a GPU: from there on the
model-parallel setup (megatron's groups, gloo groups included) is what a GPU run executes,
while every tensor stays on the CPU. A process-group branch on the device that leaves out
a group the optimizer asks for fails here as it would on a GPU node.
"""

import sys

from megatron_jreg import train
from megatron_jreg.distributed import setup
from megatron_jreg.training import trainer  # noqa: F401  (binds its names before the switch)

setup.initialize_distributed()  # gloo and the CPU redirection: tensors stay on the CPU
setup.use_cpu = lambda: False   # the process-group setup now sees a GPU

sys.exit(train.main(sys.argv[1:]))
