"""Chat templates for SFT data: which template, rendering it, and the exact loss mask.

A conversation is rendered to text by a jinja template (as Hugging Face's
``apply_chat_template`` does) and tokenised once; :class:`ChatEncoder` returns the token ids and
a loss mask over each assistant message's content and the end-of-turn token after it, or refuses
the conversation when no exact mask exists. Used by the SFT preprocessing workers
(``sft_workers``), so it imports neither megatron-core nor torch (jinja2 comes with torch).
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime

from megatron_jreg.config.tokenizer_names import SENTENCEPIECE_TOKENIZERS
from megatron_jreg.errors import InputError

# The Tulu format (open-instruct's ``tulu`` template, a newline after every message):
# <|system|>\n{content}\n, <|user|>\n{content}\n, <|assistant|>\n{content}{eos}\n.
# The backslash-n pairs are jinja string escapes, as in a tokenizer_config.json.
TULU_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ '<|system|>\\n' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'user' %}"
    "{{ '<|user|>\\n' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
TEMPLATE_CHOICES = ("auto", "tulu", "tokenizer")
ROLES = ("system", "user", "assistant")

# ByteTokenizer has no text for its special ids; these names match the Hugging Face export
# of a byte-tokenizer checkpoint, so an exported template renders the same text.
BYTE_EOS_TEXT = "<|eod|>"
BYTE_BOS_TEXT = "<|bos|>"

# Reasons a conversation is refused, as counted with --skip-invalid.
TEMPLATE_FAILED = "chat template error"
SPECIAL_TEXT = "special token text in content"
CONTENT_CHANGED = "template changes the content"
MASK_BOUNDARY = "token across a loss-mask boundary"
NO_END_OF_TURN = "no end-of-turn token"

_SENTINEL = "\ue000sft-content\ue001"  # private-use code points: no real content holds them

# A conversation every usable template renders; checked once before any work.
_PROBE = [
    {"role": "user", "content": "Hi there."},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
]


class ConversationError(Exception):
    """A conversation this template and tokenizer cannot turn into tokens and a mask."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _tokenizer_dir(tokenizer_type: str, tokenizer_model: str | None) -> str | None:
    if tokenizer_type == "ByteTokenizer" or not tokenizer_model:
        return None
    if os.path.isdir(tokenizer_model):
        return tokenizer_model
    return os.path.dirname(os.path.abspath(tokenizer_model))


def tokenizer_chat_template(tokenizer_type: str, tokenizer_model: str | None) -> str | None:
    """The tokenizer's own template: ``chat_template.jinja`` (newer transformers) or the
    ``chat_template`` of ``tokenizer_config.json`` beside the model; None when it has none."""
    directory = _tokenizer_dir(tokenizer_type, tokenizer_model)
    if directory is None:
        return None
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    config_path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(config_path):
        return None
    try:
        with open(config_path, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
    except ValueError as e:
        raise InputError(f"{config_path}: not valid JSON ({e}); fix or remove it") from None
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
        if template is None:
            raise InputError(
                f"{config_path}: chat_template holds named templates {sorted(named)} but no "
                f"'default'; pass one as a .jinja file with --chat-template")
    return template if isinstance(template, str) else None


def resolve_chat_template(choice: str, tokenizer_type: str,
                          tokenizer_model: str | None) -> tuple[str, str]:
    """(name, jinja text) for ``--chat-template``: auto, tulu, tokenizer or a .jinja path.

    ``auto`` is the tokenizer's own template when it has one, else ``tulu``. Raises
    InputError naming the flag and the fix.
    """
    if choice == "tulu":
        return "tulu", TULU_TEMPLATE
    if choice in ("auto", "tokenizer"):
        own = tokenizer_chat_template(tokenizer_type, tokenizer_model)
        if own is not None:
            return "tokenizer", own
        if choice == "auto":
            return "tulu", TULU_TEMPLATE
        raise InputError(
            f"--chat-template tokenizer: the {tokenizer_type} "
            f"{tokenizer_model or ''} has no chat template (Hugging Face keeps it in "
            f"tokenizer_config.json or chat_template.jinja); use --chat-template tulu or a "
            f".jinja file")
    if not os.path.isfile(choice):
        raise InputError(
            f"--chat-template {choice!r} is not auto, tulu, tokenizer or an existing .jinja "
            f"file")
    try:
        with open(choice, encoding="utf-8") as f:
            return choice, f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--chat-template {choice!r}: cannot read it ({e})") from None


def compile_template(text: str):
    """A jinja template compiled the way transformers compiles chat templates."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(text)
    except TemplateError as e:
        where = f"line {e.lineno}: " if getattr(e, "lineno", None) else ""
        raise InputError(f"the chat template is not valid jinja ({where}{e})") from None


def _hf_token_names(directory: str | None) -> dict[str, str]:
    """``bos_token`` and the like from ``tokenizer_config.json``, for templates that use them."""
    path = os.path.join(directory, "tokenizer_config.json") if directory else None
    if not path or not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    names = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            names[name] = value
    return names


def _special_tokens(tokenizer, tokenizer_model: str | None
                    ) -> tuple[dict[str, int], dict[str, str], bool]:
    """(special text -> id, template variables, whether the tokenizer splits specials itself).

    Hugging Face tokenizers find their special tokens in text themselves; sentencepiece and
    the byte tokenizer do not, so for them the text is cut at the special texts here.
    """
    kind = type(tokenizer).__name__
    if kind == "HuggingFaceTokenizer":
        tok = tokenizer._tok
        specials = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        eos = tok.id_to_token(tokenizer.eod)
        specials.setdefault(eos, tokenizer.eod)
        names = _hf_token_names(_tokenizer_dir(kind, tokenizer_model))
        names["eos_token"] = eos  # the token preprocessing and training end documents with
        return specials, names, True
    if kind in SENTENCEPIECE_TOKENIZERS:
        sp = tokenizer._sp
        names = {"eos_token": sp.IdToPiece(tokenizer.eod)}
        if tokenizer.bos >= 0:
            names["bos_token"] = sp.IdToPiece(tokenizer.bos)
        ids = {"eos_token": tokenizer.eod, "bos_token": tokenizer.bos}
        return {text: ids[name] for name, text in names.items()}, names, False
    names = {"eos_token": BYTE_EOS_TEXT, "bos_token": BYTE_BOS_TEXT}
    return {BYTE_EOS_TEXT: tokenizer.eod, BYTE_BOS_TEXT: tokenizer.bos}, names, False


class ChatEncoder:
    """Renders conversations with one template and tokenises them with their loss mask."""

    def __init__(self, tokenizer, template_text: str, tokenizer_model: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template_text = template_text
        self._template = compile_template(template_text)
        self.specials, self.variables, self._native = _special_tokens(tokenizer, tokenizer_model)
        self.special_ids = frozenset(self.specials.values())
        longest_first = sorted(self.specials, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, longest_first)))
        self._split_re = re.compile(f"({self._special_re.pattern})")

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.variables)
        except TemplateError as e:
            raise ConversationError(TEMPLATE_FAILED, f"the chat template failed: {e}") from None

    def encode_text(self, text: str) -> list[int]:
        """Token ids of rendered text, special token texts as their ids."""
        if self._native:
            return self.tokenizer.encode(text)
        ids: list[int] = []
        for i, part in enumerate(self._split_re.split(text)):
            if i % 2:
                ids.append(self.specials[part])
            elif part:
                ids.extend(self.tokenizer.encode(part))
        return ids

    def check(self) -> None:
        """Encode a plain conversation; a template that cannot give a mask fails here, once.

        A template that refuses the probe's shape (``raise_exception``) is left to the data.
        """
        try:
            self.encode(_PROBE)
        except ConversationError as e:
            if e.reason != TEMPLATE_FAILED:
                raise InputError(e.detail) from None

    def encode(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """Token ids of the rendered conversation and its 0/1 loss mask (same length)."""
        for n, message in enumerate(messages, start=1):
            found = self._special_re.search(message["content"])
            if found:
                raise ConversationError(SPECIAL_TEXT, (
                    f"message {n} holds {found.group()!r}, the text of a special token: it "
                    f"would be read as that token"))
        # Why the mask is exact: the content's character span [c0, c1) in the rendered text F
        # is located with a sentinel (the conversation up to that message rendered with the
        # content replaced by a marker; the text before the marker must start F). Then
        # tokens(F[:c0]) and tokens(F[:c1]) must both be prefixes of tokens(F), and the tokens
        # between their lengths spell exactly F[c0:c1]. A template and tokenizer that merge
        # text across such a boundary (a BPE token spanning header and content) are refused,
        # never masked approximately.
        full = self.render(messages)
        ids = self.encode_text(full)
        mask = [0] * len(ids)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start, end = self._content_span(messages, i, full)
            k0 = self._boundary(full, start, ids, i, "start")
            k1 = self._boundary(full, end, ids, i, "end") if end > start else k0
            k2 = self._end_of_turn(ids, k1, i)
            mask[k0:k2 + 1] = [1] * (k2 + 1 - k0)
        return ids, mask

    def _content_span(self, messages: list[dict], i: int, full: str) -> tuple[int, int]:
        """Characters [start, end) of message ``i``'s content in ``full``."""
        marked = messages[:i] + [{"role": "assistant", "content": _SENTINEL}]
        text = self.render(marked)
        start = text.find(_SENTINEL)
        if start < 0 or text.find(_SENTINEL, start + 1) >= 0 or not full.startswith(text[:start]):
            raise ConversationError(CONTENT_CHANGED, (
                f"the chat template does not render assistant message {i + 1}'s content once, "
                f"after the same text as in the whole conversation, so its tokens cannot be "
                f"found for the loss mask"))
        content = messages[i]["content"]
        for candidate in (content, content.strip()):  # some templates strip the content
            if full.startswith(candidate, start):
                return start, start + len(candidate)
        raise ConversationError(CONTENT_CHANGED, (
            f"the chat template changes assistant message {i + 1}'s content (beyond stripping "
            f"whitespace), so its tokens cannot be found for the loss mask"))

    def _boundary(self, full: str, char: int, ids: list[int], i: int, where: str) -> int:
        """Token index at character ``char``: the text before it must tokenise to a prefix."""
        head = self.encode_text(full[:char])
        if ids[:len(head)] != head:
            raise ConversationError(MASK_BOUNDARY, (
                f"this chat template and tokenizer join text across the {where} of assistant "
                f"message {i + 1}'s content into one token, so no loss mask can split them "
                f"exactly"))
        return len(head)

    def _end_of_turn(self, ids: list[int], k: int, i: int) -> int:
        """Index of the special token that ends assistant message ``i`` (whitespace may precede
        it, as in Llama-2's `` </s>``)."""
        j = k
        while j < len(ids) and ids[j] not in self.special_ids:
            j += 1
        if j == len(ids) or self.tokenizer.decode(ids[k:j]).strip():
            raise ConversationError(NO_END_OF_TURN, (
                f"the chat template puts no special token right after assistant message "
                f"{i + 1}'s content, so the model could not learn to end a turn; end it with "
                f"{{{{ eos_token }}}}"))
        return j
