"""What a training run reads: ``gpt`` (megatron-core's GPT datasets, checked), ``sft`` and
``sft_samples`` (chat datasets and their packed samples), ``sample_order`` (Megatron-LM's
cyclic order), ``batches`` (a data-parallel rank's micro-batches), ``blend`` (``--data-path``
parsed into prefixes and weights), ``token_range`` and ``run_data_check`` (the data checked
against the run). Nothing is imported here."""
