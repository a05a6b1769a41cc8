"""SFT data (``preprocess_data.py --sft``): templates, the exact loss mask, errors. The
datasets as written and read, and the training samples over them: test_sft_reference.py.

Every expected text and token sequence here is computed without the code under test: the
templates are re-rendered by hand in Python, and the whole rendered conversation is
tokenised with the tokenizer library itself (sentencepiece, ``tokenizers``, UTF-8 bytes).
"""

import json
import os
import re
import shutil

import numpy
import pytest
from preprocess_helpers import write_jsonl

from megatron_jreg.commands.preprocess import main
from megatron_jreg.data.datasets.sft import SFTDataset
from megatron_jreg.data.preprocess.chat_templates import (
    TULU_TEMPLATE,
    ChatEncoder,
    ConversationError,
)
from megatron_jreg.data.tokenizers.build import build_tokenizer
from sft_reference import CONVERSATIONS, run_sft, tulu_parts, tulu_text

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CUSTOM = ("{% for m in messages %}{% if m['role'] == 'assistant' %}### Assistant:\n"
          "{{ m['content'] }}{{ eos_token }}\n{% else %}### {{ m['role'] | capitalize }}:\n"
          "{{ m['content'] }}\n{% endif %}{% endfor %}")


def chatml_parts(messages, eos):
    """ChatML: a turn ends with <|im_end|> (a special token, not the EOS)."""
    parts = []
    for m in messages:
        if m["role"] == "assistant":
            parts += [("<|im_start|>assistant\n", 0), (m["content"] + "<|im_end|>", 1),
                      ("\n", 0)]
        else:
            parts.append((f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n", 0))
    return parts


def custom_parts(messages, eos):
    parts = []
    for m in messages:
        if m["role"] == "assistant":
            parts += [("### Assistant:\n", 0), (m["content"] + eos, 1), ("\n", 0)]
        else:
            parts.append((f"### {m['role'].capitalize()}:\n{m['content']}\n", 0))
    return parts


# -- tokenizers, seen through their own libraries -------------------------------------------
class Reference:
    """Whole-text tokenisation and exact per-token text, from the tokenizer library itself."""

    def __init__(self, kind, model):
        self.kind, self.model = kind, model
        if kind == "ByteTokenizer":
            self.eos_text, self.eos = "<|eod|>", 256
        elif kind == "SentencePieceTokenizer":
            import sentencepiece

            self.sp = sentencepiece.SentencePieceProcessor(model_file=model)
            self.eos, self.eos_text = self.sp.eos_id(), self.sp.id_to_piece(self.sp.eos_id())
        else:
            from tokenizers import Tokenizer

            path = os.path.join(model, "tokenizer.json") if os.path.isdir(model) else model
            self.hf = Tokenizer.from_file(path)
            self.eos_text = "<|endoftext|>"
            self.eos = self.hf.token_to_id(self.eos_text)

    def encode(self, text):
        if self.kind == "HuggingFaceTokenizer":  # finds its special tokens itself
            return self.hf.encode(text, add_special_tokens=False).ids
        ids = []
        for i, part in enumerate(text.split(self.eos_text)):
            if i:
                ids.append(self.eos)
            if part:
                ids += list(part.encode()) if self.kind == "ByteTokenizer" else self.sp.encode(part)
        return ids

    def text(self, ids):
        """The exact text of ``ids`` (sentencepiece: its dummy-prefix spaces included)."""
        if self.kind == "ByteTokenizer":
            return b"".join(self.eos_text.encode() if i == 256 else bytes([i])
                            for i in ids).decode()
        if self.kind == "HuggingFaceTokenizer":
            return self.hf.decode(list(ids), skip_special_tokens=False)
        out = b""
        for i in ids:
            piece = self.sp.id_to_piece(int(i))
            byte = re.fullmatch(r"<0x([0-9A-F]{2})>", piece)
            out += bytes([int(byte.group(1), 16)]) if byte else piece.replace("▁", " ").encode()
        return out.decode()

    def spelled(self, parts):
        """``parts`` as ``self.text`` spells their tokens: sentencepiece puts a space before
        each stretch of text that starts the conversation or follows a special token (its
        dummy prefix)."""
        if self.kind != "SentencePieceTokenizer":
            return parts
        out, fresh = [], True
        for text, masked in parts:
            pieces = text.split(self.eos_text)
            pieces = [(" " + p if p and (fresh or k) else p) for k, p in enumerate(pieces)]
            out.append((self.eos_text.join(pieces), masked))
            fresh = (not pieces[-1]) and (len(pieces) > 1 or fresh)
        return out


def runs(mask):
    """[start, end) of each maximal run of equal mask values, with the value."""
    edges = [0] + [i for i in range(1, len(mask)) if mask[i] != mask[i - 1]] + [len(mask)]
    return [(a, b, int(mask[a])) for a, b in zip(edges, edges[1:])]


def check_conversation(ref, messages, render, tokens, mask):
    """The contract: the whole rendered text tokenised once; mask 1 on exactly each
    assistant content and the end-of-turn token after it, 0 on everything else."""
    parts = render(messages, ref.eos_text)
    assert list(tokens) == ref.encode("".join(text for text, _ in parts))
    spelled = ref.spelled(parts)
    for value in (1, 0):
        got = [ref.text(tokens[a:b]) for a, b, v in runs(mask) if v == value]
        expected = [text for text, masked in spelled if masked == value]
        if value == 1:
            assert got == expected  # each assistant content + its end-of-turn token
        else:
            assert "".join(got) == "".join(expected)


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory, hf_tokenizer_json):
    """An HF tokenizer directory whose tokenizer_config.json carries a ChatML template; its
    turns end with <|im_end|>, a special token that is not the EOS."""
    from tokenizers import Tokenizer

    d = tmp_path_factory.mktemp("chatml")
    tok = Tokenizer.from_file(hf_tokenizer_json)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "chat_template": CHATML}))
    return str(d)


CASES = {  # name: (tokenizer, its model fixture, --chat-template, renderer)
    "byte-tulu": ("ByteTokenizer", None, "tulu", tulu_parts),
    "sentencepiece-tulu": ("SentencePieceTokenizer", "sp_model", "auto", tulu_parts),
    "hf-bpe-tulu": ("HuggingFaceTokenizer", "hf_tokenizer_json", "auto", tulu_parts),
    "hf-own-template": ("HuggingFaceTokenizer", "chatml_dir", "auto", chatml_parts),
    "byte-jinja-file": ("ByteTokenizer", None, "FILE", custom_parts),
    "hf-bpe-jinja-file": ("HuggingFaceTokenizer", "hf_tokenizer_json", "FILE", custom_parts),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mask_is_exact_for_each_template_and_tokenizer(tmp_path, request, capsys, case):
    kind, fixture, template, render = CASES[case]
    model = request.getfixturevalue(fixture) if fixture else None
    if template == "FILE":
        template = str(tmp_path / "custom.jinja")
        (tmp_path / "custom.jinja").write_text(CUSTOM)
    flags = ["--tokenizer-type", kind, "--chat-template", template]
    flags += ["--tokenizer-model", model] if model else []
    rc, _, prefix = run_sft(tmp_path, CONVERSATIONS, *flags)
    assert rc == 0, capsys.readouterr().err
    ds = SFTDataset(prefix + "_sft_document")
    ref = Reference(kind, model)
    assert len(ds) == len(CONVERSATIONS)
    for i, messages in enumerate(CONVERSATIONS):
        sample = ds[i]
        assert sample["tokens"].dtype == numpy.int64 and sample["loss_mask"].dtype == numpy.int64
        assert len(sample["tokens"]) == len(sample["loss_mask"]) == ds.lengths[i]
        check_conversation(ref, messages, render, sample["tokens"], sample["loss_mask"])
    meta = ds.metadata
    expected_name = {"tulu": "tulu", "auto": "tokenizer" if case == "hf-own-template"
                     else "tulu"}.get(template, template)
    assert meta["chat_template_name"] == expected_name
    assert ds.chat_template == {"tulu": TULU_TEMPLATE, "tokenizer": CHATML}.get(
        expected_name, CUSTOM)
    assert meta["tokenizer_type"] == kind and meta["tokenizer_model"] == model
    assert meta["eod"] == build_tokenizer(kind, model).eod
    counts = meta["counts"]
    assert counts["conversations"] == 4 and counts["skipped"] == counts["truncated"] == 0
    assert counts["tokens"] == int(ds.lengths.sum())
    assert counts["loss_tokens"] == sum(int(ds[i]["loss_mask"].sum()) for i in range(len(ds)))
    # one EOS-like token per assistant message, plus its content
    assert counts["loss_tokens"] >= 7


def test_tulu_jinja_renders_the_documented_format():
    enc = ChatEncoder(build_tokenizer("ByteTokenizer"), TULU_TEMPLATE)
    for messages in CONVERSATIONS:
        clean = [{"role": m["role"], "content": m["content"]} for m in messages]
        assert enc.render(clean) == tulu_text(clean, "<|eod|>")
        assert enc.render(clean, add_generation_prompt=True) == tulu_text(
            clean, "<|eod|>") + "<|assistant|>\n"


def test_templates_render_as_transformers_does(chatml_dir):
    """The jinja environment matches apply_chat_template: what the HF export will render."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(chatml_dir, "tokenizer.json"), eos_token="<|endoftext|>")
    tok = build_tokenizer("HuggingFaceTokenizer", chatml_dir)
    for template in (TULU_TEMPLATE, CHATML, CUSTOM):
        enc = ChatEncoder(tok, template, chatml_dir)
        for messages in CONVERSATIONS:
            clean = [{"role": m["role"], "content": m["content"]} for m in messages]
            for prompt in (False, True):
                assert enc.render(clean, prompt) == hf.apply_chat_template(
                    clean, chat_template=template, tokenize=False, add_generation_prompt=prompt)


def test_whitespace_before_the_end_of_turn_token_is_masked_in():
    """Llama-2 style ``content + ' ' + eos``: the space belongs to the answer's ending."""
    template = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} "
                "[/INST]{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}")
    tok = build_tokenizer("ByteTokenizer")
    ids, mask = ChatEncoder(tok, template).encode(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert bytes(i for i in ids if i < 256) == b"[INST] hi [/INST] yo "
    assert [i for i, m in zip(ids, mask) if m] == [ord("y"), ord("o"), ord(" "), 256]


GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "hello"}]})
BAD_LINES = [
    ('{"messages": [unterminated', "malformed JSON"),
    ('["a", "list"]', "expected a JSON object, got list"),
    ('{"text": "no messages"}', "missing key 'messages' (keys present: text)"),
    ('{"messages": "hi"}', "'messages' is str, expected a list"),
    ('{"messages": []}', "empty conversation"),
    ('{"messages": ["hi"]}', "message 1 is str, expected an object"),
    ('{"messages": [{"role": "tool", "content": "x"}]}', "message 1 has role 'tool'"),
    ('{"messages": [{"content": "x"}]}', "message 1 has role None"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 5}]}',
     "content of message 2 is int, expected a string"),
    ('{"messages": [{"role": "user", "content": null}]}', "content of message 1 is NoneType"),
    ('{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}',
     "no assistant message"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", '
     '"content": "a <|eod|> b"}]}', "message 2 holds '<|eod|>', the text of a special token"),
]


def leftovers(directory, inputs):
    return sorted(set(os.listdir(directory)) - set(inputs))


@pytest.mark.parametrize("bad, message", BAD_LINES)
def test_bad_line_stops_with_file_and_line(tmp_path, capsys, bad, message):
    rc, data, _ = run_sft(tmp_path, [GOOD] * 30 + [bad] + [GOOD] * 5, "--tokenizer-type",
                          "ByteTokenizer", "--workers", "2", "--chunk-bytes", "64")
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"{data}:31: " in err and message in err and "--skip-invalid" in err
    assert leftovers(tmp_path, ["out.jsonl"]) == []


def test_skip_invalid_counts_every_reason(tmp_path, capsys):
    lines = [GOOD] + [bad for bad, _ in BAD_LINES] + ["", GOOD]
    rc, data, prefix = run_sft(tmp_path, lines, "--tokenizer-type", "ByteTokenizer",
                               "--skip-invalid", "--chunk-bytes", "64")
    out = capsys.readouterr().out
    assert rc == 0
    assert f"skipped {len(BAD_LINES)}" in out
    assert f"skipped 1 x malformed JSON (first at {data}:2)" in out
    ds = SFTDataset(prefix + "_sft_document")
    assert len(ds) == 2
    counts = ds.metadata["counts"]
    assert counts["skipped"] == len(BAD_LINES)
    assert counts["skipped_by_reason"]["bad role"] == 2
    assert counts["skipped_by_reason"]["non-string content"] == 2


def test_a_token_across_the_content_boundary_is_an_error(tmp_path, capsys, hf_tokenizer_json):
    """A template whose header ends in 'T' before content 'he ...': BPE makes one token 'The'
    of both, so no mask splits them; the line is named, nothing is written."""
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(hf_tokenizer_json).token_to_id("The") is not None
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{% if m['role'] == 'assistant' %}"
                        "{{ '<|assistant|>\\nT' + m['content'] + eos_token }}{% else %}"
                        "{{ m['content'] + '\\n' }}{% endif %}{% endfor %}")
    bad = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "he quick fox."}]
    good = [{"role": "user", "content": "q"}, {"role": "assistant", "content": " ok."}]
    rc, data, _ = run_sft(tmp_path, [good, good, bad], "--tokenizer-type", "HuggingFaceTokenizer",
                          "--tokenizer-model", hf_tokenizer_json, "--chat-template", str(template))
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"{data}:3: " in err and "join text across the start of assistant message 2" in err
    assert leftovers(tmp_path, ["out.jsonl", "t.jinja"]) == []


@pytest.mark.parametrize("case, message", [
    ("no end of turn", "--chat-template T.jinja: the chat template puts no special token right "
                       "after assistant message 2's content"),
    ("bad jinja", "the chat template is not valid jinja"),
    ("missing file", "is not auto, tulu, tokenizer or an existing .jinja file"),
    ("tokenizer has none", "--chat-template tokenizer: the ByteTokenizer"),
    ("append-eod", "--append-eod does not apply with --sft"),
    ("json-keys", "--json-keys does not apply with --sft"),
    ("template without --sft", "--chat-template only applies with --sft"),
    ("bad length", "--max-seq-length must be at least 1"),
    ("output exists", "out_sft_document.json already exists; pass --overwrite"),
])
def test_usage_errors_exit_2_before_any_output(tmp_path, capsys, case, message):
    data = write_jsonl(tmp_path / "in.jsonl", [{"messages": CONVERSATIONS[0]}])
    template = tmp_path / "T.jinja"
    template.write_text({"no end of turn": "{% for m in messages %}{{ m['content'] }}\n"
                                           "{% endfor %}",
                         "bad jinja": "{% for m in messages %}"}.get(case, ""))
    args = ["--sft", "--input", data, "--output-prefix", str(tmp_path / "out"),
            "--tokenizer-type", "ByteTokenizer"]
    extra = {"no end of turn": ["--chat-template", str(template)],
             "bad jinja": ["--chat-template", str(template)],
             "missing file": ["--chat-template", str(tmp_path / "none.jinja")],
             "tokenizer has none": ["--chat-template", "tokenizer"],
             "append-eod": ["--append-eod"], "json-keys": ["--json-keys", "messages"],
             "bad length": ["--max-seq-length", "0"]}.get(case, [])
    if case == "no end of turn":
        message = message.replace("T.jinja", str(template))
    if case == "template without --sft":
        args = args[1:]
        extra = ["--chat-template", "tulu"]
    if case == "output exists":
        (tmp_path / "out_sft_document.json").write_text("{}")
    before = leftovers(tmp_path, [])
    assert main(args + extra) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert leftovers(tmp_path, []) == before


def test_rerun_with_overwrite_replaces_the_metadata(tmp_path, capsys):
    args = ("--tokenizer-type", "ByteTokenizer", "--overwrite")
    assert run_sft(tmp_path, CONVERSATIONS, *args)[0] == 0
    (tmp_path / "c.jinja").write_text(CUSTOM)
    rc, _, prefix = run_sft(tmp_path, CONVERSATIONS[:1], *args, "--chat-template",
                            str(tmp_path / "c.jinja"))
    assert rc == 0
    ds = SFTDataset(prefix + "_sft_document")
    assert len(ds) == 1 and ds.chat_template == CUSTOM


def test_conversation_error_for_a_template_that_changes_content():
    template = ("{% for m in messages %}{{ m['content'] | replace('b', 'B') }}{{ eos_token }}"
                "{% endfor %}")
    enc = ChatEncoder(build_tokenizer("ByteTokenizer"), template)
    with pytest.raises(ConversationError, match="changes assistant message 2's content"):
        enc.encode([{"role": "user", "content": "q"}, {"role": "assistant", "content": "abc"}])
    # stripped content is found (Llama-2 and Mistral templates strip it)
    template = "{% for m in messages %}{{ m['content'] | trim }}{{ eos_token }}{% endfor %}"
    ids, mask = ChatEncoder(build_tokenizer("ByteTokenizer"), template).encode(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  abc \n"}])
    assert [i for i, m in zip(ids, mask) if m] == [ord("a"), ord("b"), ord("c"), 256]


def test_tokenizer_template_from_chat_template_jinja_or_named_list(tmp_path, hf_tokenizer_json):
    from megatron_jreg.data.preprocess.chat_templates import resolve_chat_template

    shutil.copy(hf_tokenizer_json, tmp_path / "tokenizer.json")
    kind = "HuggingFaceTokenizer"
    assert resolve_chat_template("auto", kind, str(tmp_path)) == ("tulu", TULU_TEMPLATE)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML}]}))
    assert resolve_chat_template("auto", kind, str(tmp_path)) == ("tokenizer", CHATML)
    (tmp_path / "chat_template.jinja").write_text(CUSTOM)  # newer transformers save this
    assert resolve_chat_template("tokenizer", kind, str(tmp_path / "tokenizer.json")) == (
        "tokenizer", CUSTOM)
    assert resolve_chat_template("tulu", kind, str(tmp_path)) == ("tulu", TULU_TEMPLATE)


