"""initialize_model_parallel keeps megatron's groups when asked again for the same layout in
the same world (eval_jump over a run's checkpoints: megatron's destroy drops its NCCL groups
without freeing them), and makes them again once they were destroyed. (A world of one has
one layout; eval_jump's layouts under torchrun are tests/analysis/test_eval_jump_torchrun.py.)"""

from megatron.core import parallel_state

from megatron_jreg.config.model import ModelConfig, ParallelConfig
from megatron_jreg.distributed.setup import initialize_distributed, initialize_model_parallel


def test_same_layout_keeps_the_groups():
    initialize_distributed()
    model = ModelConfig.from_preset("tiny", vocab_size=128)
    initialize_model_parallel(model, ParallelConfig())
    tp_group = parallel_state.get_tensor_model_parallel_group()
    dp_gloo = parallel_state.get_data_parallel_group_gloo()
    initialize_model_parallel(model, ParallelConfig())
    assert parallel_state.get_tensor_model_parallel_group() is tp_group
    assert parallel_state.get_data_parallel_group_gloo() is dp_gloo
    parallel_state.destroy_model_parallel()  # destroyed elsewhere: made again
    initialize_model_parallel(model, ParallelConfig())
    assert parallel_state.model_parallel_is_initialized()
    assert parallel_state.get_tensor_model_parallel_group() is not tp_group
