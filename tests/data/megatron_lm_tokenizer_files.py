"""Tokenizer files of every Megatron-LM tokenizer type, made here with no download, and the
small corpus the byte-for-byte comparisons with Megatron-LM's ``tools/preprocess_data.py``
run on. The files are built the same way each time; the tests check their sha256 against
the one recorded with the reference ids, so a library that trains them otherwise shows as a
changed file, not as changed ids."""

import hashlib
import json
import os

from preprocess_helpers import SENTENCES

# non-ASCII, an empty text, and the literal texts of the types' special tokens
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Unicode text: café, naïve, 東京, emoji 🙂 and digits 12345.",
    "",
    "special texts <CLS> and <SEP> then <EOD> or <MASK>; <s> </s> <unk> <|endoftext|> "
    "<|begin_of_text|> end",
    "  two leading spaces\nand a newline",
]
# NullTokenizer reads ids: Megatron-LM's fails on a text that is not ids, so no empty one
NULL_CORPUS = ["1 2 3", "499 0 7 7", "42"]
NULL_VOCAB = 500

_TRAIN_TEXT = SENTENCES * 20 + CORPUS


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def make_sentencepiece(directory: str) -> str:
    """A byte-fallback BPE sentencepiece model (unk 0, bos 1, eos 2, no pad), as
    tools/train_tokenizer.py trains."""
    from megatron_jreg.data.tokenizers.training import TrainTokenizerConfig, train_sentencepiece

    corpus = os.path.join(directory, "sp_train.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        f.write("\n".join(_TRAIN_TEXT) + "\n")
    return train_sentencepiece(TrainTokenizerConfig(
        input=[corpus], model_prefix=os.path.join(directory, "sp"), vocab_size=381,
        input_format="text"))


def make_gpt2_files(directory: str) -> tuple[str, str]:
    """GPT-2 style vocab.json and merges.txt (byte-level BPE) with <|endoftext|>."""
    from tokenizers import ByteLevelBPETokenizer

    corpus = os.path.join(directory, "bpe_train.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        f.write("\n".join(_TRAIN_TEXT) + "\n")
    bpe = ByteLevelBPETokenizer()
    bpe.train([corpus], vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"],
              show_progress=False)
    bpe.save_model(directory)
    return os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")


def make_hf_llama3_style(directory: str) -> str:
    """A Hugging Face tokenizer directory that adds its own BOS as Llama 3's does: byte-level
    BPE, <|begin_of_text|> before every text, EOS <|end_of_text|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_TRAIN_TEXT, trainers.BpeTrainer(
        vocab_size=400, special_tokens=[bos, eos], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos,
                            eos_token=eos).save_pretrained(directory)
    return directory


def write_corpus(path: str, texts) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
    return path
