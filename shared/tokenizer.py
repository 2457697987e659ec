"""Tokenization, chat templates and streaming detokenization, without torch.

The router imports this module, so it depends only on ``tokenizers`` and
``jinja2``. Encoding, decoding and chat-template rendering follow what
``transformers.AutoTokenizer`` does on the same directory, so prompts and
outputs are identical to a Hugging Face run of the same checkpoint.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from shared.tokenizer_class import apply_class_pipeline, resolve_tokenizer_class

# Named special tokens a chat template may refer to (``bos_token`` etc.).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REPLACEMENT_CHAR = "\ufffd"
BYTE_FALLBACK_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class TokenizerLoadError(ValueError):
    """A tokenizer directory that cannot be used; the message names the file."""


def _token_content(value: Any) -> str | None:
    """Special tokens appear as plain strings or as serialized AddedToken dicts."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise TokenizerLoadError(f"{path}: not valid JSON ({e})") from None


def _clean_up_tokenization(text: str) -> str:
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text; rendering keeps the body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Unlike jinja's own filter, no HTML escaping: templates emit JSON into prompts, not web pages.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox configured like Hugging Face's."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """A Hugging Face tokenizer directory: ``tokenizer.json`` plus ``tokenizer_config.json``.

    As in transformers, the ``tokenizer.json`` post-processor alone decides
    which special tokens ``encode`` adds; ``add_bos_token``/``add_eos_token``
    in ``tokenizer_config.json`` are ignored when ``tokenizer.json`` exists.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        config: Mapping[str, Any],
        chat_templates: Mapping[str, str] | None = None,
    ) -> None:
        self._backend = backend
        self._config = dict(config)
        self.special_tokens: dict[str, str] = {}
        for name in NAMED_SPECIAL_TOKENS:
            content = _token_content(self._config.get(name))
            if content is not None:
                self.special_tokens[name] = content
        self._chat_templates = dict(chat_templates or {})
        self._compiled: dict[str, jinja2.Template] = {}
        self._clean_up_spaces = bool(self._config.get("clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE"
        )
        self.byte_fallback_ids = self._find_byte_fallback_ids()
        self._special_ids = sorted(i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
        self.bos_token_id = self._special_id("bos_token")
        self.eos_token_id = self._special_id("eos_token")
        self.pad_token_id = self._special_id("pad_token")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load a Hugging Face directory, or the tokenizer embedded in a ``.gguf`` file."""
        if str(model_dir).lower().endswith(".gguf"):
            return cls.from_gguf(model_dir)
        model_dir = Path(model_dir)
        tokenizer_path = model_dir / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise TokenizerLoadError(f"{tokenizer_path}: file not found; a fast-tokenizer tokenizer.json is required")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_path))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise TokenizerLoadError(f"{tokenizer_path}: cannot be loaded ({e})") from None
        config_path = model_dir / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        # Follow the class transformers would pick where its pipeline differs from tokenizer.json's.
        apply_class_pipeline(backend, resolve_tokenizer_class(model_dir, config), config)
        return cls(backend, config, _load_chat_templates(model_dir, config))

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer and chat template stored in a GGUF file's metadata."""
        from shared.models.gguf_file import open_gguf
        from shared.models.gguf_tokenizer import tokenizer_parts

        tokenizer_json, config = tokenizer_parts(open_gguf(os.path.abspath(path)))
        templates = {"default": config["chat_template"]} if "chat_template" in config else {}
        return cls(BackendTokenizer.from_str(tokenizer_json), config, templates)

    # -- special tokens -----------------------------------------------------------------------

    def _special_id(self, name: str) -> int | None:
        content = self.special_tokens.get(name)
        return None if content is None else self._backend.token_to_id(content)

    def _find_byte_fallback_ids(self) -> frozenset[int]:
        """Ids of ``<0xNN>`` tokens of a byte-fallback (sentencepiece-style) BPE model."""
        if not getattr(self._backend.model, "byte_fallback", False):
            return frozenset()
        vocab = self._backend.get_vocab(with_added_tokens=False)
        return frozenset(i for token, i in vocab.items() if BYTE_FALLBACK_TOKEN.fullmatch(token))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's embedding may be larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters in the longest token (added ones included): ``n`` characters need at least
        ``n / max_token_chars`` tokens, which bounds a prompt's length before it is tokenized."""
        return max((len(t) for t in self._backend.get_vocab(with_added_tokens=True)), default=1) or 1

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of added tokens flagged special: exactly those ``decode(skip_special_tokens=True)`` drops."""
        return list(self._special_ids)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` (transformers' ``convert_ids_to_tokens``)."""
        return self._backend.id_to_token(token_id)

    # -- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    # -- chat -----------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_templates)

    def _template(self, tools: Any) -> jinja2.Template:
        if not self._chat_templates:
            raise ValueError(
                "this model has no chat template (no chat_template.jinja and no chat_template in "
                "tokenizer_config.json); use the completions endpoint or add a template to the model directory"
            )
        name = "tool_use" if tools is not None and "tool_use" in self._chat_templates else "default"
        if name not in self._chat_templates:
            raise ValueError(f"chat templates {sorted(self._chat_templates)} have no 'default' entry")
        if name not in self._compiled:
            self._compiled[name] = compile_chat_template(self._chat_templates[name])
        return self._compiled[name]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render the conversation to the prompt string (encode it with ``add_special_tokens=False``)."""
        variables: dict[str, Any] = {**self.special_tokens, **template_kwargs}
        return self._template(tools).render(
            messages=[dict(m) for m in messages],
            tools=None if tools is None else [dict(t) for t in tools],
            documents=None if documents is None else [dict(d) for d in documents],
            add_generation_prompt=add_generation_prompt,
            **variables,
        )


def _load_chat_templates(model_dir: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """``chat_template.jinja`` (and ``chat_templates/*.jinja``) take precedence over the config field."""
    templates: dict[str, str] = {}
    value = config.get("chat_template")
    if isinstance(value, str):
        templates["default"] = value
    elif isinstance(value, list):
        templates.update({entry["name"]: entry["template"] for entry in value})
    template_dir = model_dir / "chat_templates"
    if template_dir.is_dir():
        for path in sorted(template_dir.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    template_file = model_dir / "chat_template.jinja"
    if template_file.is_file():
        templates["default"] = template_file.read_text(encoding="utf-8")
    return templates


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas that are safe to stream.

    The concatenation of every ``add`` result and the final ``flush`` equals
    ``tokenizer.decode(output_ids, skip_special_tokens)``. Each step decodes a
    short window: the tokens emitted in the last visible step (context, so
    decoders that treat a leading token specially stay consistent) plus the
    tokens not yet emitted. Text ending in U+FFFD is held back: it is usually a
    multi-byte character whose remaining bytes arrive with the next token.

    ``prompt_ids`` is accepted so callers can hand over the request as is; the
    output text is defined without it, as Hugging Face's ``decode`` of the
    generated ids alone.

    Byte-fallback tokenizers decode a run of ``<0xNN>`` tokens as one unit and
    turn the whole run into U+FFFD if any byte in it is invalid, so a run is
    held back until a regular token ends it.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self.prompt_len = len(prompt_ids)
        self.output_ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # tokens before this have been emitted
        self._skipped_ids = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        self._in_byte_run = False
        # The text of output_ids[prefix_offset:read_offset] for the offsets it was decoded at: the context of
        # the next window is most often what _advance just decoded (one decode per token saved).
        self._context: tuple[int, int, str] = (0, 0, "")

    def _context_text(self) -> str:
        start, end, text = self._context
        if (start, end) != (self._prefix_offset, self._read_offset):
            text = self._tokenizer.decode(self.output_ids[self._prefix_offset : self._read_offset],
                                          self._skip_special_tokens)  # fmt: skip
            self._context = (self._prefix_offset, self._read_offset, text)
        return text

    def _delta(self) -> str:
        context_text = self._context_text()
        window_text = self._tokenizer.decode(self.output_ids[self._prefix_offset :], self._skip_special_tokens)
        return window_text[len(context_text) :] if len(window_text) > len(context_text) else ""

    def _advance(self) -> None:
        """Mark every token emitted; the just-emitted ones become the next window's context.

        The context must decode to visible text: decoders that strip the first
        token's leading space would otherwise strip a space the full decode keeps
        (e.g. after a skipped special token), so an invisible step keeps the old context.
        """
        new_context = self.output_ids[self._read_offset :]
        text = self._tokenizer.decode(new_context, self._skip_special_tokens)
        if text:
            self._prefix_offset = self._read_offset
            self._context = (self._read_offset, len(self.output_ids), text)
        self._read_offset = len(self.output_ids)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text that became stable."""
        self.output_ids.append(token_id)
        if token_id not in self._skipped_ids:  # skipped tokens vanish before decoding, so runs span them
            self._in_byte_run = token_id in self._tokenizer.byte_fallback_ids
        if self._in_byte_run:
            return ""
        delta = self._delta()
        if delta.endswith(REPLACEMENT_CHAR):
            return ""
        self._advance()
        return delta

    def flush(self) -> str:
        """Return whatever is still held back (e.g. bytes that never formed a character)."""
        if self._read_offset == len(self.output_ids):
            return ""
        delta = self._delta()
        self._advance()
        return delta


def find_stop(text: str, stop: Sequence[str], start: int) -> int | None:
    """Index where the earliest stop string begins in ``text``, or None.

    ``start`` is how much of ``text`` was already searched; only positions where
    a match could newly appear (overlapping the text after ``start``) are checked.
    """
    stop = [s for s in stop if s]
    if not stop:
        return None
    search_from = max(0, start - max(len(s) for s in stop) + 1)
    found = [i for i in (text.find(s, search_from) for s in stop) if i >= 0]
    return min(found) if found else None


def holdback_len(text: str, stop: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could be the beginning of a stop string.

    Streaming emits ``text[:len(text) - holdback_len(text, stop)]`` so a stop
    string that completes later is never shown to the client.
    """
    longest = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest
