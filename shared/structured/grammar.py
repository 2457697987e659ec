"""xgrammar backend: compiled grammars cached per constraint, matchers, token bitmasks.

One ``GrammarBackend`` serves one engine (one tokenizer, one vocabulary). Its
cache maps a ``Constraint`` to a compiled grammar; compilation is thread-safe
and meant to run off the engine thread (``compile`` from an executor), so that
a slow schema never stalls a batch. A matcher per request tracks the grammar
state as tokens are accepted; ``fill_bitmask`` writes the allowed-token masks
of the constrained rows of one step.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from pathlib import Path

import torch
import xgrammar as xgr

from shared.engine.sampling_params import InvalidRequestError
from shared.structured.constraint import Constraint, choice_ebnf

logger = logging.getLogger("cleave.structured")

DEFAULT_CACHE_SIZE = 256


def tokenizer_info(model_dir: str | Path, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of a model's tokenizer (directory or GGUF); ``vocab_size`` is the logits' width."""
    from tokenizers import Tokenizer as BackendTokenizer

    text = _tokenizer_json(model_dir)
    backend = BackendTokenizer.from_str(text)
    vocab = backend.get_vocab(with_added_tokens=True)
    encoded = [""] * max(vocab_size, max(vocab.values()) + 1)
    for token, token_id in vocab.items():
        encoded[token_id] = token
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(text)
    return xgr.TokenizerInfo(
        encoded[:vocab_size],
        xgr.VocabType(metadata["vocab_type"]),
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids,
        add_prefix_space=bool(metadata["add_prefix_space"]),
    )


# xgrammar spells the characters of a length-bounded JSON string as this class, which
# lets raw control characters through (invalid JSON); such strings get the class below.
_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\"\\\0-\x1f\uD800-\uDFFF]"
# Its class for the characters of other strings.
_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"
# Both classes also take the UTF-8 spelling of a UTF-16 surrogate (bytes ED A0 80 ... ED BF BF), which
# no valid UTF-8 text contains: decoded, each of its three bytes is a U+FFFD, so a string the grammar
# counted as 6 characters long came out 8 long (seen with maxLength 6 on a byte-level vocabulary).
_NO_SURROGATES = r"\uD800-\uDFFF]"


def json_schema_ebnf(schema: str) -> str:
    """EBNF of a JSON schema in compact form (free whitespace would let a model pad forever)."""
    grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    grammar = grammar.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)
    return grammar.replace(_STRING_CHAR, _STRING_CHAR[:-1] + _NO_SURROGATES)


def _tokenizer_json(model: str | Path) -> str:
    """``tokenizer.json`` of a model directory, or the one a ``.gguf`` file's metadata describes."""
    if str(model).lower().endswith(".gguf"):
        from shared.models.gguf_file import open_gguf
        from shared.models.gguf_tokenizer import tokenizer_parts

        return tokenizer_parts(open_gguf(str(Path(model).resolve())))[0]
    return (Path(model) / "tokenizer.json").read_text(encoding="utf-8")


class GrammarBackend:
    """Compiles constraints (LRU-cached) and makes matchers for one tokenizer."""

    def __init__(self, info: xgr.TokenizerInfo, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.info = info
        self.vocab_size = info.vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self._cache: OrderedDict[Constraint, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiled = 0

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, vocab_size: int, stop_token_ids: list[int]) -> GrammarBackend:
        return cls(tokenizer_info(model_dir, vocab_size, stop_token_ids))

    def cached(self, constraint: Constraint) -> bool:
        with self._lock:
            return constraint in self._cache

    def compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        """The compiled grammar (from the cache when it is there); InvalidRequestError says what is wrong."""
        with self._lock:
            compiled = self._cache.get(constraint)
            if compiled is not None:
                self._cache.move_to_end(constraint)
                return compiled
        compiled = self._compile_uncached(constraint)
        with self._lock:
            self._cache[constraint] = compiled
            self.num_compiled += 1
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile_uncached(self, constraint: Constraint) -> xgr.CompiledGrammar:
        kind, spec = constraint.kind, constraint.spec
        try:
            if kind == "json":
                json.loads(spec)  # xgrammar's message for broken JSON is terse
                return self._compiler.compile_grammar(json_schema_ebnf(spec))
            if kind == "json_object":
                # OpenAI's json_object mode answers with an object, never a bare array or scalar.
                return self._compiler.compile_grammar(json_schema_ebnf('{"type": "object"}'))
            if kind == "regex":
                return self._compiler.compile_regex(spec)
            if kind == "choice":
                choices = constraint.choices()
                if not choices or not all(isinstance(c, str) and c for c in choices):
                    raise InvalidRequestError("choice must be a non-empty list of non-empty strings")
                return self._compiler.compile_grammar(choice_ebnf(choices))
            return self._compiler.compile_grammar(spec)
        except InvalidRequestError:
            raise
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}") from None
        except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses with the parser's reason
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InvalidRequestError(f"the {_KIND_NAMES[kind]} does not compile: {reason}") from None

    def matcher(self, constraint: Constraint) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self.compile(constraint))


_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON grammar",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
}


class BitmaskFiller:
    """Fills the masks of a step's constrained rows in one call into xgrammar (no Python loop).

    One thread by default: a mask takes microseconds, less than waking a thread pool costs.
    """

    def __init__(self, max_threads: int = 1) -> None:
        self._batch = xgr.BatchGrammarMatcher(max_threads=max_threads)

    def fill(self, matchers: list, rows: list[int], vocab_size: int) -> torch.Tensor:
        """[len(matchers), ceil(vocab / 32)] int32 with row r filled from ``matchers[r]`` for r in ``rows``.

        Bit t of a filled row set = token t allowed; rows outside ``rows`` stay all-allowed and unused.
        """
        bitmask = xgr.allocate_token_bitmask(len(matchers), vocab_size)
        self._batch.batch_fill_next_token_bitmask([matchers[r] for r in rows], bitmask, indices=rows)
        return bitmask
