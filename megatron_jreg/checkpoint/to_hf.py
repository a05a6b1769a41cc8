"""Export a checkpoint of our trainer to a Hugging Face directory of its model family.

    python tools/convert_to_hf.py --load CKPT [--iteration N] --output DIR

The family follows from the run's architecture flags (``ModelConfig.family``): Llama, Qwen3,
Mixtral or GPT-2; an architecture no family has is refused in one line. The weights come
from the TP1 PP1 model that :func:`model_loader.load_model` rebuilds (any saved layout), on
one process, renamed by :mod:`.hf_families`; the tokenizer is written beside them.
"""

from __future__ import annotations

import os
import shutil
from typing import Dict, List, Optional

import torch

from megatron_jreg.atomic_write import (
    check_output_dir,
    give_open_modes,
    temp_dir_beside,
)
from megatron_jreg.checkpoint import dist_checkpoint as ckpt
from megatron_jreg.checkpoint.hf_families import (  # noqa: F401 (also this module's API)
    HF_CLASSES,
    check_exportable,
    hf_config,
    hf_state_dict,
    llama_config_kwargs,
    megatron_to_hf_state_dict,
    split_qkv,
)
from megatron_jreg.checkpoint.model_loader import load_model
from megatron_jreg.checkpoint.run_configs import (
    build_run_tokenizer,
    checkpoint_sources,
    launched_world_size,
)
from megatron_jreg.config.tokenizer_names import SENTENCEPIECE_TOKENIZERS
from megatron_jreg.data.tokenizers.records import LEGACY_IDS
from megatron_jreg.errors import InputError, missing_extra
from megatron_jreg.hf_models import DTYPE_NAMES, torch_dtype
from megatron_jreg.writer_lock import output_lock

# ---- tokenizers ----------------------------------------------------------------------------


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's byte -> printable character table, which tokenizers' ByteLevel applies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def byte_tokenizer_fast(eod: int, bos: int, pad: int):
    """A PreTrainedTokenizerFast that gives ByteTokenizer's ids: byte b -> b, no merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: b for b, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = sorted([(eod, "<|eod|>"), (bos, "<|bos|>"), (pad, "<|pad|>")])
    if [i for i, _ in specials] != list(range(256, 256 + len(specials))):
        raise ValueError(f"ByteTokenizer special ids {specials} are not 256, 257, 258")
    tok.add_special_tokens([AddedToken(text, special=True) for _, text in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|eod|>", bos_token="<|bos|>", pad_token="<|pad|>"
    )


def _sentencepiece_tokenizer(model_file: str, out_dir: str):
    from transformers import LlamaTokenizer

    shutil.copyfile(model_file, os.path.join(out_dir, "tokenizer.model"))
    # the trainer's data has no BOS/EOS inside documents (EOD between them): add none
    return LlamaTokenizer.from_pretrained(out_dir, add_bos_token=False, add_eos_token=False)


def export_tokenizer(configs, out_dir: str, tokenizer_model: Optional[str] = None,
                     chat_template: Optional[str] = None) -> List[str]:
    """Write the run's tokenizer into ``out_dir`` in HF form; returns warnings to print.

    The exported tokenizer is checked to give the trainer's ids on a sample text. An SFT
    run's ``chat_template`` goes into ``tokenizer_config.json``, so ``apply_chat_template``
    renders conversations as the model was fine-tuned on them. A NullTokenizer run (its
    text is ids) has no tokenizer to export: InputError.
    """
    data = configs["data"]
    if data.tokenizer_type == "NullTokenizer":
        raise InputError(
            "the run's NullTokenizer reads ids, not text, so there is no tokenizer to export; "
            "pass --no-tokenizer"
        )
    run_tokenizer = build_run_tokenizer(configs, tokenizer_model)
    if data.tokenizer_type in SENTENCEPIECE_TOKENIZERS and run_tokenizer.split_tokens():
        raise InputError(
            f"the run's --legacy-tokenizer {data.tokenizer_type} cuts texts at "
            f"{', '.join(run_tokenizer.split_tokens())} and encodes each piece with its own "
            "leading space, which the Hugging Face tokenizers here do not reproduce; pass "
            "--no-tokenizer (the weights convert) and tokenize with the run's tokenizer")
    if data.tokenizer_type == "ByteTokenizer":
        hf = byte_tokenizer_fast(run_tokenizer.eod, run_tokenizer.bos, run_tokenizer.pad)
    elif data.tokenizer_type in SENTENCEPIECE_TOKENIZERS:
        hf = _sentencepiece_tokenizer(tokenizer_model or data.tokenizer_model, out_dir)
    elif data.tokenizer_type == "Llama2Tokenizer":
        from transformers import LlamaTokenizer

        shutil.copyfile(tokenizer_model or data.tokenizer_model,
                        os.path.join(out_dir, "tokenizer.model"))
        # BOS first where the run's ids have it (--legacy-tokenizer), as the trainer's
        legacy = run_tokenizer.unique_identifiers.get("ids") == LEGACY_IDS
        hf = LlamaTokenizer.from_pretrained(out_dir, add_bos_token=legacy, add_eos_token=False)
    elif data.tokenizer_type == "GPT2BPETokenizer":
        from transformers import GPT2TokenizerFast

        # GPT-2's own two files, under the names every transformers version reads; BOS, EOS
        # and UNK default to <|endoftext|>, the run's EOD
        shutil.copyfile(run_tokenizer.vocab_file, os.path.join(out_dir, "vocab.json"))
        shutil.copyfile(run_tokenizer.merge_file, os.path.join(out_dir, "merges.txt"))
        hf = GPT2TokenizerFast.from_pretrained(out_dir)
    else:
        from transformers import PreTrainedTokenizerFast

        model_file = tokenizer_model or data.tokenizer_model
        json_path = (
            os.path.join(model_file, "tokenizer.json") if os.path.isdir(model_file) else model_file
        )
        eos = run_tokenizer._tok.id_to_token(run_tokenizer.eod)
        hf = PreTrainedTokenizerFast(tokenizer_file=json_path, eos_token=eos)
        if run_tokenizer.unique_identifiers.get("ids") != LEGACY_IDS:
            from tokenizers import processors

            # the run's ids (Megatron-LM's default) have none of the tokenizer's own special
            # tokens (a Llama 3 BOS): the export adds none either
            hf.backend_tokenizer.post_processor = processors.TemplateProcessing(
                single="$A", pair="$A $B", special_tokens=[])
    if chat_template:
        hf.chat_template = chat_template
        # in tokenizer_config.json, where every transformers version reads it (recent ones
        # would write a separate chat_template.jinja that older ones ignore)
        hf.save_pretrained(out_dir, save_jinja_files=False)
    else:
        hf.save_pretrained(out_dir)
    sample = "Hello world: héllo 123.\nThe end."
    got = list(hf(sample, add_special_tokens=True)["input_ids"])
    want = list(run_tokenizer.encode(sample))
    if got != want:
        return [
            f"the exported tokenizer gives other ids than the run's {data.tokenizer_type} on a "
            f"sample ({got[:8]}... vs {want[:8]}...); check it before evaluating"
        ]
    return []


# ---- conversion ----------------------------------------------------------------------------


def _check_output(output: str) -> None:
    if os.path.exists(output):
        raise InputError(f"--output {output}: already exists; remove it or choose a new directory")
    # the export is written beside --output and renamed: its parent must take new files
    check_output_dir(os.path.dirname(os.path.abspath(output)), "--output", output)


def convert(
    root: str,
    output: str,
    iteration: Optional[int] = None,
    dtype: str = "float32",
    tokenizer_model: Optional[str] = None,
    skip_tokenizer: bool = False,
) -> List[str]:
    """Write the HF directory ``output`` (atomically: a temp dir renamed); returns warnings.
    One writer per ``output``: a second conversion to it is refused while this one runs."""
    check_output_dir(os.path.dirname(os.path.abspath(output)), "--output", output)
    with output_lock(output, "--output"):
        return _convert(root, output, iteration, dtype, tokenizer_model, skip_tokenizer)


def _convert(root, output, iteration, dtype, tokenizer_model, skip_tokenizer) -> List[str]:
    _check_output(output)
    if dtype not in DTYPE_NAMES:
        raise InputError(f"--dtype {dtype}: choose one of {sorted(DTYPE_NAMES)}")
    if tokenizer_model is not None and not os.path.exists(tokenizer_model):
        raise InputError(f"--tokenizer-model {tokenizer_model}: no such file or directory")
    if launched_world_size() > 1:
        raise InputError(
            "reading a checkpoint runs on one process (the weights are resharded to TP1 PP1); "
            "run the tool with python, not torchrun"
        )
    (source,) = checkpoint_sources(root, iteration=iteration)
    try:
        import transformers
    except ImportError:
        raise missing_extra("transformers", "hf", "tools/convert_to_hf.py") from None

    loaded = load_model(source, device="cpu", dtype="float32")
    cfg = loaded.model_config
    family = check_exportable(cfg)
    hf_state = hf_state_dict(loaded.model.state_dict(), cfg)
    config = hf_config(cfg, loaded.padded_vocab_size)
    model_class = getattr(transformers, HF_CLASSES[family])
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tmp = temp_dir_beside(output)
    warnings: List[str] = []
    try:
        if not skip_tokenizer:
            template = source.opened.read_text(ckpt.CHAT_TEMPLATE)
            carried = source.format.carried_tokenizer
            from transformers import AutoTokenizer

            if carried and tokenizer_model is None:
                # the Hugging Face tokenizer files the checkpoint carries (an imported
                # model's): written back as they came, chat template included
                carried_tok = AutoTokenizer.from_pretrained(carried)
                if template:
                    carried_tok.chat_template = template
                carried_tok.save_pretrained(tmp)
            else:
                warnings += export_tokenizer(loaded.configs, tmp, tokenizer_model, template)

            tok = AutoTokenizer.from_pretrained(tmp)
            config.bos_token_id = tok.bos_token_id
            config.eos_token_id = tok.eos_token_id
            config.pad_token_id = tok.pad_token_id
        torch.manual_seed(0)  # the random init is overwritten below
        model = model_class(config).eval()
        missing, unexpected = model.load_state_dict(hf_state, strict=False)
        missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")
                   and not (config.tie_word_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise RuntimeError(
                f"weight mapping incomplete: missing {missing}, unexpected {unexpected}"
            )
        model.to(torch_dtype(dtype))
        model.save_pretrained(tmp, safe_serialization=True)
        give_open_modes(tmp)
        try:
            os.rename(tmp, output)
        except OSError:  # a writer that ignores the lock made --output meanwhile: it stays
            raise InputError(f"--output {output}: another process wrote it while this export "
                             "ran; its files are kept, this one's removed: choose a new "
                             "directory") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return warnings
