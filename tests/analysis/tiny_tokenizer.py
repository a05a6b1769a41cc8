"""The word-level tokenizer of the tiny Hugging Face test models (no download): w0..w89 and
four special tokens; it adds <s> itself. Shared by tests/analysis/conftest.py and the import
tests (a module of its own: ``conftest`` names another directory's module in a whole-suite
run)."""

VOCAB_WORDS = [f"w{i}" for i in range(90)]
SPECIAL = ["[UNK]", "[PAD]", "<s>", "</s>"]


def save_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + VOCAB_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # The tokenizer adds <s> itself, so "special tokens as the tokenizer adds them" matters.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        bos_token="<s>",
        eos_token="</s>",
    )
    fast.save_pretrained(path)
