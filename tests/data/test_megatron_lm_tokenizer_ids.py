"""Every --tokenizer-type here writes, with tools/preprocess_data.py, the bytes Megatron-LM
core_v0.16.1's tools/preprocess_data.py writes, by default and with --legacy-tokenizer, and
the trainer's EOD and padded vocabulary are Megatron-LM's; Megatron-LM names not built here
are refused in one line; a run recorded with a type's earlier ids here is named in one line.

The reference sha256s below came from Megatron-LM core_v0.16.1's own script, run from its
source tree on the files ``megatron_lm_tokenizer_files`` makes and ``CORPUS`` without its
empty text (Megatron-LM keeps an empty document; tools/preprocess_data.py here refuses it
or, with --skip-invalid, skips it):

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix OUT --workers 1 \\
        --tokenizer-type TYPE FILES [--append-eod] [--legacy-tokenizer]

each type both ways, but GPT2BPETokenizer with --legacy-tokenizer only: without it,
Megatron-LM loads "gpt2" from the Hugging Face hub whatever files are given (here it reads
the files, and gives the same ids either way). The vocabulary and EOD figures came from its
``megatron.training.tokenizer.build_tokenizer`` (``_vocab_size_with_padding``,
--make-vocab-size-divisible-by 128, tensor parallel 1), which sizes its model with or
without --legacy-tokenizer, and for the EOD of default data from its
``megatron.core.tokenizers`` ``build_tokenizer``."""

import hashlib
import os

import megatron_lm_tokenizer_files as files
import pytest

from megatron_jreg.commands.preprocess import main
from megatron_jreg.config.model import ModelConfig
from megatron_jreg.data.tokenizers.build import build_tokenizer
from megatron_jreg.errors import InputError

# the fixture files the references were made from
FILE_SHA256 = {
    "sp.model": "d5d68a845d51ca30fedada29000b522ff3cf911ffbf5f3618648de8d7bf0458e",
    "gpt2/vocab.json": "43caaedfec876a4078cf444e3461a4b226a7a8b5117291a781b50d6c6941f01a",
    "gpt2/merges.txt": "efae329b26d0cf7c1884c36cae9c95d2aa91d0477068d3a3e445452e0b0a63ff",
    "hf/tokenizer.json": "10dd612603ea3a86ee77c8401aa3ca37b770bb40880618a3157f95f7b4ba937d",
}

_SP_PLAIN = ("f4285432ecbee6ae41b95f12b72eb313dc0c5f63b895be30f7e0ae70bed6b222",
             "aa2faa12bd96dd4d0b072cdda52800a9a0a0d656fd042243af21ad39489f1990")
_SP_PLAIN_EOD = ("b6cc286b6686b74b924cba940002f8d7163ddf47164dc8c8e88ed2bd573a6633",
                 "12ff65f4e17cd5e9cb6a7309b09591029d8eb1fcd22127ec2a39d64bb79c5868")
_GPT2 = ("e707f6ab4a656bee449798394eb8b21757b8735aadaed5164aed13c2eb415200",
         "04a0b4e0cf767309b47fd214228962bce3ff1205b794f3f1de5e30aa3b1907aa")
_GPT2_EOD = ("42cd94e5fec7d5acdeb89aac4a3dddab491b32947a20937f95df5fbc011d4921",
             "15f7d01a66d89bb2174c80bee7f202c64dcbc531e219570b44c115ec0b87df21")
# ids [[1, 2, 3], [499, 0, 7, 7], [42]], then each followed by EOD 500
_NULL = ("bf3f22b439e3ed4c0b7184e7c597ae0c8a06691194aeaf59a2adc519e4c1eb92",
         "3466cc538ad86c3526783548eba853e1046bbeb6b29b61389de9e8b46d0b1d05")
_NULL_EOD = ("a23251a3fa736c925afef8a79d05cd71f68b31aa4f54eb33486f2284705b84e4",
             "293bc3671b9354db4d0cfe7514a217a3c5167b9afa9ce9233007c04683a51cf7")
# (type, --append-eod, --legacy-tokenizer) -> sha256 of Megatron-LM's .bin and .idx
REFERENCE = {
    ("GPTSentencePieceTokenizer", False, False): _SP_PLAIN,
    ("GPTSentencePieceTokenizer", True, False): _SP_PLAIN_EOD,
    ("GPTSentencePieceTokenizer", False, True): _SP_PLAIN,
    ("GPTSentencePieceTokenizer", True, True): _SP_PLAIN_EOD,
    ("SentencePieceTokenizer", False, False): _SP_PLAIN,
    ("SentencePieceTokenizer", True, False): _SP_PLAIN_EOD,
    # <CLS> <SEP> <EOD> <MASK> <PAD> added as 381-385, the texts of those and of <s> </s>
    # one id each, EOD <EOD> (383)
    ("SentencePieceTokenizer", False, True): (
        "d982a8e933a6570c8c63831a885516a8e78f121e9cb885d7dbbb0b61004e68a2",
        "32b29205256658e362541b29bc7ced49fff0aa3e72c8460233613ac13d2621bb"),
    ("SentencePieceTokenizer", True, True): (
        "894326fff67b52d41851aacbc1bb6069130782498e54bd85e6b80388775c660e",
        "cc425fd470e267e41139544569678979dadb1d161e86eb4969773ad007ecd0be"),
    ("Llama2Tokenizer", False, False): _SP_PLAIN,
    ("Llama2Tokenizer", True, False): _SP_PLAIN_EOD,
    # BOS (1) before every text
    ("Llama2Tokenizer", False, True): (
        "09910c4d3fdb47e27f61d9e97a4df3b9b998aa022d8bb8fd31216fd979022cd3",
        "12ff65f4e17cd5e9cb6a7309b09591029d8eb1fcd22127ec2a39d64bb79c5868"),
    ("Llama2Tokenizer", True, True): (
        "ba63ae482fe933b7619b33ea45a16e3127c03f8814f2a5ef55ae491f899b6417",
        "531d71b45a0c0ed2f6e44066d10fbb424d23e594244d3035a3005032224eda47"),
    ("HuggingFaceTokenizer", False, False): (
        "2607d11d8cdf42ed4494da086b0c6ccb94454d89f2f3f71c9f0f727c373e7210",
        "4aea242a33990679134cc8cdc4a34d26e08825940cebe8e898ea534b6586c05b"),
    ("HuggingFaceTokenizer", True, False): (
        "b5773aaf9f32f40c25528c20841debcbd02257b6bd564d73cb9556d66dcab2d6",
        "0568e83f0cd92125d596f2d902aef69d7991a702b04d6bf4c7d54ac58bcaa1e0"),
    # the tokenizer's <|begin_of_text|> before every text
    ("HuggingFaceTokenizer", False, True): (
        "2b833d1db289cec03c91c33e680fb863389ede0bc457ed7ca55e4938cccb1470",
        "0568e83f0cd92125d596f2d902aef69d7991a702b04d6bf4c7d54ac58bcaa1e0"),
    ("HuggingFaceTokenizer", True, True): (
        "421e948afda3ef5677823b6ed13dcdcade6d70e2e80d05d9650f4211636b8404",
        "6f286be4993472c7e2038a59d3084c180c0acaafc3302c377c02fcab50de65a9"),
    ("GPT2BPETokenizer", False, True): _GPT2,
    ("GPT2BPETokenizer", True, True): _GPT2_EOD,
    ("NullTokenizer", False, False): _NULL,
    ("NullTokenizer", True, False): _NULL_EOD,
    ("NullTokenizer", False, True): _NULL,
    ("NullTokenizer", True, True): _NULL_EOD,
}

# Megatron-LM's trainer on these files: (tokenizer vocab, padded vocab, EOD of default
# data, EOD of --legacy-tokenizer data)
TRAINER = {
    "SentencePieceTokenizer": (386, 512, 2, 383),
    "GPTSentencePieceTokenizer": (381, 384, 2, 2),
    "Llama2Tokenizer": (381, 384, 2, 2),
    "HuggingFaceTokenizer": (400, 512, 1, 1),
    "GPT2BPETokenizer": (400, 512, 0, 0),
    "NullTokenizer": (501, 512, 500, 500),
}


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("megatron_lm_files"))
    files.make_sentencepiece(root)
    os.makedirs(os.path.join(root, "gpt2"))
    files.make_gpt2_files(os.path.join(root, "gpt2"))
    files.make_hf_llama3_style(os.path.join(root, "hf"))
    changed = [n for n, h in FILE_SHA256.items() if sha256(os.path.join(root, n)) != h]
    assert not changed, f"tokenizer files made otherwise than when recorded: {changed}"
    return root


def tokenizer_flags(kind, root):
    if kind == "GPT2BPETokenizer":
        return ["--vocab-file", f"{root}/gpt2/vocab.json", "--merge-file",
                f"{root}/gpt2/merges.txt"]
    if kind == "HuggingFaceTokenizer":
        return ["--tokenizer-model", f"{root}/hf"]
    if kind == "NullTokenizer":
        return ["--vocab-size", str(files.NULL_VOCAB)]
    return ["--tokenizer-model", f"{root}/sp.model"]


def preprocess(tmp_path, made, kind, *flags):
    texts = files.NULL_CORPUS if kind == "NullTokenizer" else [t for t in files.CORPUS if t]
    corpus = files.write_corpus(str(tmp_path / "corpus.jsonl"), texts)
    prefix = str(tmp_path / "out")
    assert main(["--input", corpus, "--output-prefix", prefix, "--workers", "1", "--overwrite",
                 "--tokenizer-type", kind, *tokenizer_flags(kind, made), *flags]) == 0
    return sha256(prefix + "_text_document.bin"), sha256(prefix + "_text_document.idx")


@pytest.mark.parametrize("kind,append_eod,legacy", list(REFERENCE))
def test_preprocess_writes_megatron_lms_bytes(tmp_path, made, kind, append_eod, legacy):
    flags = [*(["--append-eod"] if append_eod else []),
             *(["--legacy-tokenizer"] if legacy else [])]
    assert preprocess(tmp_path, made, kind, *flags) == REFERENCE[kind, append_eod, legacy]


def test_gpt2_bpe_gives_the_same_ids_without_legacy_tokenizer(tmp_path, made):
    # Megatron-LM's default GPT2BPETokenizer needs the hub; this one reads the files given
    assert preprocess(tmp_path, made, "GPT2BPETokenizer", "--append-eod") == _GPT2_EOD


def build(kind, root, legacy=False):
    flags = tokenizer_flags(kind, root)
    kwargs = {"tokenizer_model": None, "vocab_size": None}
    for flag, value in zip(flags[::2], flags[1::2]):
        kwargs[flag[2:].replace("-", "_")] = int(value) if flag == "--vocab-size" else value
    return build_tokenizer(kind, legacy=legacy, **kwargs)


@pytest.mark.parametrize("kind", list(TRAINER))
def test_trainer_eod_and_padded_vocab_are_megatron_lms(made, kind):
    default, legacy = build(kind, made), build(kind, made, legacy=True)
    padded = ModelConfig(vocab_size=default.vocab_size).padded_to_multiple()
    assert legacy.vocab_size == default.vocab_size
    assert (default.vocab_size, padded, default.eod, legacy.eod) == TRAINER[kind]


@pytest.mark.parametrize("name, use", [
    ("BertWordPieceLowerCase", "HuggingFaceTokenizer"),
                                       ("BertWordPieceCase", "HuggingFaceTokenizer"),
    ("TikTokenizer", "HuggingFaceTokenizer"), ("MultimodalTokenizer", "HuggingFaceTokenizer"),
    ("NullMultimodalTokenizer", "NullTokenizer"), ("SFTTokenizer", "--sft"),
])
def test_megatron_lm_names_not_built_here_are_refused_in_one_line(tmp_path, capsys, name, use):
    corpus = files.write_corpus(str(tmp_path / "c.jsonl"), ["a"])
    assert main(["--input", corpus, "--output-prefix", str(tmp_path / "o"),
                 "--tokenizer-type", name]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and name in err[0] and use in err[0], err
    with pytest.raises(InputError, match=f"{name} .*{use}"):
        build_tokenizer(name)


def test_both_sentencepiece_names_give_the_same_ids_under_their_own_identity(made):
    gpt = build_tokenizer("GPTSentencePieceTokenizer", f"{made}/sp.model")
    plain = build_tokenizer("SentencePieceTokenizer", f"{made}/sp.model")
    texts = [t for t in files.CORPUS if t]
    assert gpt.encode_batch(texts) == plain.encode_batch(texts)
    assert (gpt.eod, gpt.vocab_size) == (plain.eod, 381)
    assert plain.vocab_size == 386  # Megatron-LM's legacy pieces, counted either way
    assert gpt.unique_identifiers["class"] == "GPTSentencePieceTokenizer"
    assert plain.unique_identifiers["class"] == "SentencePieceTokenizer"
