"""Per-request sampling settings (torch-free, validated at construction)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.structured.constraint import Constraint

GREEDY_EPSILON = 1e-5
INT32_MAX = 2**31 - 1


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message says what to change."""


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return besides the sampled one
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (offline API; benchmarks)
    # Token-level controls, applied by shared.engine.token_constraints before the penalties.
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # sequences that must not be completed
    prompt_logprobs: int | None = None  # score the prompt's tokens, with this many top alternatives
    # Embedding request: pool the prompt's final hidden states ("last" or "mean"); see shared.engine.pooling.
    pooling: str | None = None
    normalize: bool = True  # L2-normalize the pooled embedding
    constraint: Constraint | None = None  # structured output: JSON schema, regex, choice or grammar
    # Beam search (shared.engine.beam_search): best_of beams (default n), the n best returned.
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0  # a finished beam scores sum(logprobs) / num_tokens ** length_penalty
    early_stopping: bool | str = False  # as transformers: True, False (heuristic) or "never"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def fail(msg: str) -> None:
            raise InvalidRequestError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            fail(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                fail(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            fail(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= INT32_MAX:
            fail(f"top_k must be -1, 0 (disabled) or a positive integer up to {INT32_MAX}, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            fail(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            fail(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            fail(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            fail(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            fail(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.pooling not in (None, "last", "mean"):
            fail(f"pooling must be 'last' or 'mean', got {self.pooling!r}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            fail(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop strings must be non-empty strings")
        if self.stop and not self.detokenize:
            fail("stop strings need detokenize=True")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63):
            fail(f"seed must be an integer in [-2**63, 2**63), got {self.seed!r}")
        self._validate_token_controls(fail)
        self._validate_beam_search(fail)

    def _validate_token_controls(self, fail: Callable[[str], None]) -> None:
        for token_id, bias in self.logit_bias.items():
            if not isinstance(token_id, int) or token_id < 0:
                fail(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
            if not -100 <= bias <= 100:
                fail(f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            fail("allowed_token_ids must be a non-empty list of token ids")
        if any(not word or any(t < 0 for t in word) for word in self.bad_words_token_ids):
            fail("bad_words_token_ids must be non-empty lists of token ids")

    def _validate_beam_search(self, fail: Callable[[str], None]) -> None:
        if self.best_of is not None and (not isinstance(self.best_of, int) or self.best_of < self.n):
            fail(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        if self.early_stopping not in (True, False, "never"):
            fail(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")
        if not self.use_beam_search:
            if self.best_of not in (None, self.n):
                fail("best_of other than n needs use_beam_search=true")
            if self.length_penalty != 1.0 or self.early_stopping is not False:
                fail("length_penalty and early_stopping need use_beam_search=true")
            return
        if self.beam_width > 10:
            fail(f"beam search takes at most 10 beams (best_of or n), got {self.beam_width}")
        if self.temperature not in (0.0, 1.0):
            # Beams are scored by the model's own log-probabilities; tempered scores are not implemented.
            fail(f"temperature must be 0 or 1 with use_beam_search, got {self.temperature}")
        refused = {
            "stop": bool(self.stop),
            "min_tokens": self.min_tokens > 0,
            "logprobs": bool(self.logprobs),
            "prompt_logprobs": self.prompt_logprobs is not None,
            "structured output": self.constraint is not None,
            "embeddings": self.pooling is not None,
            "top_p": self.top_p < 1.0,
            "top_k": self.top_k > 0,
            "min_p": self.min_p > 0.0,
        }
        for name, present in refused.items():
            if present:
                fail(f"{name} cannot be combined with use_beam_search")

    @property
    def beam_width(self) -> int:
        """Beams kept per step in beam search: best_of, else n."""
        return self.best_of or self.n

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON
