"""Vectorized token sampler.

One `SamplingBatch` is built per step from the rows that sample in it; `Sampler`
turns the step's logits into token ids and logprobs with batched tensor ops.

Order of operations on each row's logits:
0. structured output: rows with a grammar get -inf on the tokens it forbids.
   Then token controls (``allowed_token_ids``, bad words, ``logit_bias``), see
   ``shared.engine.token_constraints``.
1. min_tokens: stop/EOS logits set to -inf while the row is below `min_tokens`.
2. penalties on the raw logits: repetition (HF), then frequency and presence (OpenAI).
3. logprobs: `log_softmax` of the logits after steps 1-2, before temperature and
   filtering, so they describe the model's (penalized) distribution, not the
   truncated one the token was drawn from.
4. greedy rows (temperature < 1e-5): argmax. Other rows: divide by temperature,
   top-k, top-p, min-p, then sample with the exponential race
   `argmax(probs / Exponential(1))`, which draws from `probs` exactly.

Rows with a seed draw their noise from their own `torch.Generator` (on the CPU,
one 64-bit key from which the native kernel derives the row's noise), so their
tokens do not depend on what else is in the batch. Before each draw the generator
is seeded with `token_seed(seed, index of the output token)`: the noise is a
function of those two numbers only, so a worker that resumes a request (after a
migration, or after the prefill worker sampled the first token) draws exactly
what an uninterrupted run would have drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import chain

import torch
from torch import Tensor

from shared.engine.sampling_params import SamplingParams
from shared.engine.token_constraints import TokenConstraints, apply_token_constraints, build_token_constraints
from shared.kernels import cpu_kernels

_NEG_INF = float("-inf")


_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    """One step of splitmix64: a fixed bijective mix of a 64-bit value."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def token_seed(seed: int, index: int) -> int:
    """The generator seed for output token ``index`` of a request seeded with ``seed``, in [0, 2**63).

    ``seed`` is read modulo 2**64, so a seed and its int64 wrap-around are the same seed.
    """
    return _splitmix64((_splitmix64(seed & _MASK64) + index) & _MASK64) >> 1


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator seeded for one request's first output token, or None for an unseeded one."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(token_seed(seed, 0))
    return generator


def _token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device | str) -> Tensor:
    """How often each token occurs in each row: [B, V] float32."""
    num_rows = len(token_ids)
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64, device=device)  # [B]
    flat_ids = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.int64, device=device)  # [T]
    rows = torch.repeat_interleave(torch.arange(num_rows, device=device), lengths)  # [T]
    counts = torch.bincount(rows * vocab_size + flat_ids, minlength=num_rows * vocab_size)  # [B * V]
    return counts.view(num_rows, vocab_size).to(torch.float32)  # [B, V]


def _min_tokens_targets(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    eos_token_ids: Sequence[int],
    vocab_size: int,
    device: torch.device | str,
) -> tuple[Tensor, Tensor] | None:
    """(row, token id) pairs to suppress for rows still below min_tokens, or None."""
    rows: list[int] = []
    token_ids: list[int] = []
    for row, (p, output) in enumerate(zip(params, output_token_ids, strict=True)):
        if len(output) >= p.min_tokens:
            continue
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        valid_ids = sorted(t for t in stop_ids if 0 <= t < vocab_size)
        rows += [row] * len(valid_ids)
        token_ids += valid_ids
    if not rows:
        return None
    rows_tensor = torch.tensor(rows, dtype=torch.int64, device=device)  # [N]
    return rows_tensor, torch.tensor(token_ids, dtype=torch.int64, device=device)  # [N], [N]


def _row_column(name: str, dtype: torch.dtype) -> cached_property[Tensor]:
    """A ``SamplingBatch`` attribute: the rows' ``name`` as a [B] tensor, made on first read."""

    def column(batch: SamplingBatch) -> Tensor:
        return torch.tensor([getattr(p, name) for p in batch.params], dtype=dtype, device=batch.device)

    return cached_property(column)


@dataclass
class SamplingBatch:
    """Per-step sampling state for the B rows that sample this step.

    The per-row parameter tensors (``temperature``, ``top_k``, the penalties, ...) are made the first
    time a step's sampling reads them: a greedy step reads none, a plain random one the temperatures
    only (eight [B] tensors from Python lists cost a fiftieth of a decode step of 64 rows).
    """

    params: list[SamplingParams]
    device: torch.device | str
    greedy_rows: list[bool]  # per row: SamplingParams.is_greedy (argmax)
    all_greedy: bool
    any_greedy: bool
    any_penalties: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    generators: list[torch.Generator | None]  # per row; None draws from the global RNG
    seeded_rows: list[int]  # rows that sample (not greedy) with their own generator
    prompt_token_ids: list[list[int]]  # per row, for the penalties
    output_token_ids: list[list[int]]
    any_repetition: bool
    any_frequency_presence: bool
    output_token_counts: Tensor | None  # [B, V] float32; made by apply_penalties where the CPU kernel does not apply
    seen_token_mask: Tensor | None  # [B, V] bool, prompt or output; made as output_token_counts
    min_tokens_rows: Tensor | None  # [N] int64, with min_tokens_token_ids: logits to set to -inf
    min_tokens_token_ids: Tensor | None  # [N] int64
    max_num_logprobs: int | None  # largest `logprobs` asked in the batch; None if no row asks
    token_constraints: TokenConstraints | None = None  # allowed ids, bad words, logit bias; None if no row asks
    # Structured output: allowed-token bitmasks, filled and applied for the constrained rows only.
    token_bitmask: Tensor | None = None  # [B, ceil(V / 32)] int32, on the logits' device
    constrained_rows: list[int] | None = None  # the rows whose bitmask row is filled

    # [B] each, from the rows' SamplingParams: top_k int64 (0 = off), the others float32 (raw request values)
    temperature = _row_column("temperature", torch.float32)
    top_p = _row_column("top_p", torch.float32)
    top_k = _row_column("top_k", torch.int64)
    min_p = _row_column("min_p", torch.float32)
    presence_penalty = _row_column("presence_penalty", torch.float32)
    frequency_penalty = _row_column("frequency_penalty", torch.float32)
    repetition_penalty = _row_column("repetition_penalty", torch.float32)

    @cached_property
    def is_greedy(self) -> Tensor:  # [B] bool
        return torch.tensor(self.greedy_rows, dtype=torch.bool, device=self.device)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        eos_token_ids: Sequence[int],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingBatch:
        assert len(params) == len(prompt_token_ids) == len(output_token_ids) == len(generators)
        greedy_rows = [p.is_greedy for p in params]
        any_repetition = any(p.repetition_penalty != 1.0 for p in params)
        any_freq_pres = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)

        min_tokens = _min_tokens_targets(params, output_token_ids, eos_token_ids, vocab_size, device)
        asked_logprobs = [p.logprobs for p in params if p.logprobs is not None]

        return cls(
            params=params,
            device=device,
            greedy_rows=greedy_rows,
            all_greedy=all(greedy_rows),
            any_greedy=any(greedy_rows),
            any_penalties=any_repetition or any_freq_pres,
            any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0.0 for p in params),
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids,
            any_repetition=any_repetition,
            any_frequency_presence=any_freq_pres,
            generators=list(generators),
            seeded_rows=[row for row, g in enumerate(generators) if g is not None and not greedy_rows[row]],
            output_token_counts=None,  # the penalties' count tensors: made when applied without the CPU kernel
            seen_token_mask=None,
            min_tokens_rows=min_tokens[0] if min_tokens else None,
            min_tokens_token_ids=min_tokens[1] if min_tokens else None,
            max_num_logprobs=max(asked_logprobs) if asked_logprobs else None,
            token_constraints=build_token_constraints(params, output_token_ids, vocab_size, device),
        )


@dataclass
class SamplerOutput:
    token_ids: Tensor  # [B] int64
    logprobs: Tensor  # [B] float32; zeros when no row of the batch asked for logprobs, logprob of the sampled token
    top_token_ids: Tensor | None  # [B, K] int64, K = max_num_logprobs; a row asking k < K reads [:k]
    top_logprobs: Tensor | None  # [B, K] float32


def apply_repetition_penalty(logits: Tensor, seen_mask: Tensor, penalty: Tensor) -> Tensor:
    """HF semantics on seen tokens: positive logits divided by the penalty, others multiplied."""
    penalty = penalty.unsqueeze(1)  # [B, 1]
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)  # [B, V]
    return torch.where(seen_mask, penalized, logits)


def apply_frequency_presence_penalties(
    logits: Tensor, output_counts: Tensor, frequency: Tensor, presence: Tensor
) -> Tensor:
    """OpenAI semantics over output tokens: minus frequency * count, minus presence * (count > 0)."""
    frequency_term = frequency.unsqueeze(1) * output_counts  # [B, V]
    presence_term = presence.unsqueeze(1) * (output_counts > 0)  # [B, V]
    return logits - frequency_term - presence_term


def apply_top_k(logits: Tensor, top_k: Tensor) -> Tensor:
    """Keep each row's top_k largest logits (ties with the k-th are kept); top_k 0 leaves a row alone."""
    k = top_k.clamp(max=logits.shape[-1])  # [B]
    max_k = int(k.max())
    if max_k == 0:
        return logits
    top_values = logits.topk(max_k, dim=-1).values  # [B, max_k], descending
    kth_value = top_values.gather(1, (k - 1).clamp(min=0).unsqueeze(1))  # [B, 1]
    remove = (logits < kth_value) & (k > 0).unsqueeze(1)  # [B, V]
    return logits.masked_fill(remove, _NEG_INF)


def apply_top_p(logits: Tensor, top_p: Tensor) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p (at least one)."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [B, V]
    sorted_probs = sorted_logits.softmax(dim=-1)  # [B, V]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [B, V], mass of higher-ranked tokens
    # top_p == 1 rows keep everything: rounding in the cumsum must not drop their tail.
    remove_sorted = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)  # [B, V]
    remove = torch.zeros_like(remove_sorted).scatter_(1, sorted_ids, remove_sorted)  # [B, V]
    return logits.masked_fill(remove, _NEG_INF)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below min_p times the row's largest probability."""
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(probs < threshold, _NEG_INF)


def greedy_argmax(logits: Tensor) -> Tensor:
    """The first largest value's index in each row [B, V] -> [B] (a NaN counts as largest), as
    ``max(dim=-1).indices`` computes it; on the CPU in one vectorised pass per row (torch's reduction
    compares one element at a time: ~0.5 ms for 64 rows of a 7k vocabulary, a fiftieth of a step)."""
    if logits.device.type == "cpu":
        ids = cpu_kernels.argmax(logits)
        if ids is not None:
            return ids
    return logits.max(dim=-1).indices  # the same first maximal index as argmax, faster on the CPU


_KEY_LOW, _KEY_HIGH = -(2**63), 2**63 - 1


def sample_exponential_race(
    logits: Tensor, temperature: Tensor, generators: list[torch.Generator | None], seeded_rows: list[int]
) -> Tensor:
    """A token per row from ``softmax(logits / temperature)`` ([B, V], [B] > 0): argmax(probs / E) with
    E ~ Exponential(1) picks token i with probability probs[i]: [B] int64.

    On the CPU each row draws one 64-bit key (from its generator, or the global one) and the native
    kernel derives the row's noise from it and reads the logits once (``cpu_kernels.sample_race``):
    torch's ``exponential_`` computes a scalar log per element, which at 32 rows of a 7k vocabulary
    took longer than the step.
    """
    if logits.device.type == "cpu":
        keys = torch.randint(_KEY_LOW, _KEY_HIGH, (logits.shape[0],), dtype=torch.int64)
        for row in seeded_rows:
            keys[row] = torch.randint(_KEY_LOW, _KEY_HIGH, (), dtype=torch.int64, generator=generators[row])
        ids = cpu_kernels.sample_race(logits, temperature, keys)
        if ids is not None:
            return ids
    probs = (logits / temperature.unsqueeze(1)).softmax(dim=-1)  # [B, V]
    noise = torch.empty_like(probs).exponential_()  # [B, V]
    for row in seeded_rows:
        noise[row].exponential_(generator=generators[row])
    # A zero draw would turn a removed token's 0 / 0 into NaN, which argmax would pick.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return greedy_argmax(probs / noise)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, rows: list[int]) -> Tensor:
    """In place: -inf on the tokens whose bit is clear, in ``rows`` only (xgrammar's CPU/CUDA kernel).

    ``logits`` [B, V] float32, ``bitmask`` [B, ceil(V / 32)] int32; bit t of row r set = token t allowed.
    """
    from xgrammar import apply_token_bitmask_inplace

    apply_token_bitmask_inplace(logits, bitmask, indices=rows)
    return logits


def apply_min_tokens_and_penalties(logits: Tensor, batch: SamplingBatch, inplace: bool = False) -> Tensor:
    """Token controls, min_tokens suppression, then penalties: [B, V], the distribution that logprobs report.
    ``inplace``: ``logits`` is the caller's to overwrite (the CPU penalties then skip a copy)."""
    if batch.token_constraints is not None:
        logits = apply_token_constraints(logits, batch.token_constraints)
    if batch.min_tokens_rows is not None:
        assert batch.min_tokens_token_ids is not None
        suppressed = (batch.min_tokens_rows, batch.min_tokens_token_ids)
        logits = logits.index_put(suppressed, torch.tensor(_NEG_INF, device=logits.device))
    if batch.any_penalties:
        logits = apply_penalties(logits, batch, inplace)
    return logits


def apply_penalties(logits: Tensor, batch: SamplingBatch, inplace: bool = False) -> Tensor:
    """Repetition, then frequency and presence penalties: on the CPU from each row's token ids
    (``cpu_kernels.apply_penalties_``, which touches only the tokens a row has seen; on a copy unless
    ``inplace``), else over [B, V] count tensors (made once per batch)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:  # the kernel's rows (no copy made for naught)
        penalised = logits if inplace else logits.clone()
        if cpu_kernels.apply_penalties_(
            penalised, batch.prompt_token_ids, batch.output_token_ids, batch.repetition_penalty,
            batch.frequency_penalty, batch.presence_penalty,
        ):  # fmt: skip
            return penalised
    vocab_size, device = logits.shape[-1], logits.device
    if batch.output_token_counts is None:
        batch.output_token_counts = _token_counts(batch.output_token_ids, vocab_size, device)  # [B, V]
    if batch.any_repetition:
        if batch.seen_token_mask is None:
            prompt_counts = _token_counts(batch.prompt_token_ids, vocab_size, device)
            batch.seen_token_mask = (prompt_counts > 0) | (batch.output_token_counts > 0)  # [B, V]
        logits = apply_repetition_penalty(logits, batch.seen_token_mask, batch.repetition_penalty)
    if batch.any_frequency_presence:
        logits = apply_frequency_presence_penalties(
            logits, batch.output_token_counts, batch.frequency_penalty, batch.presence_penalty
        )
    return logits


class Sampler:
    """Turns one step's logits into tokens and logprobs; stateless."""

    def __call__(self, logits: Tensor, batch: SamplingBatch, inplace: bool = False) -> SamplerOutput:
        """``inplace``: ``logits`` is the caller's to overwrite (the runner's, made for this step)."""
        if batch.token_bitmask is not None:
            assert batch.constrained_rows is not None
            # The runner's logits are this step's own tensor: masking them in place is safe.
            logits = apply_token_bitmask(logits, batch.token_bitmask, batch.constrained_rows)  # [B, V]
        logits = apply_min_tokens_and_penalties(logits, batch, inplace)  # [B, V]
        token_ids = self._sample(logits, batch)  # [B]
        if batch.max_num_logprobs is None:
            # No row asked for logprobs: skip the normalizer over the vocabulary.
            return SamplerOutput(token_ids, torch.zeros_like(token_ids, dtype=torch.float32), None, None)
        num_top = min(batch.max_num_logprobs, logits.shape[-1])
        native = cpu_kernels.logprobs(logits, token_ids, num_top) if logits.device.type == "cpu" else None
        if native is not None:  # one pass per row instead of a logsumexp and a topk over the vocabulary
            return SamplerOutput(token_ids, *native)
        log_normalizer = logits.logsumexp(dim=-1, keepdim=True)  # [B, 1]
        logprobs = logits.gather(1, token_ids.unsqueeze(1)) - log_normalizer  # [B, 1]
        top_values, top_token_ids = logits.topk(num_top, dim=-1)  # [B, K]
        return SamplerOutput(token_ids, logprobs.squeeze(1), top_token_ids, top_values - log_normalizer)

    @staticmethod
    def _sample(logits: Tensor, batch: SamplingBatch) -> Tensor:
        """Greedy rows take the argmax; the others sample from the filtered, tempered distribution."""
        greedy_ids = greedy_argmax(logits) if batch.any_greedy else None  # [B]
        if batch.all_greedy:
            assert greedy_ids is not None
            return greedy_ids
        # [B], a safe divisor on the greedy rows
        temperature = torch.where(batch.is_greedy, 1.0, batch.temperature) if batch.any_greedy else batch.temperature
        if batch.any_top_k or batch.any_top_p or batch.any_min_p:
            scaled = logits / temperature.unsqueeze(1)  # [B, V]
            if not (  # the native filter works on the step's own tensor in place; else torch's sorts
                scaled.device.type == "cpu"
                and cpu_kernels.filter_logits_(scaled, batch.top_k, batch.top_p, batch.min_p)
            ):
                if batch.any_top_k:
                    scaled = apply_top_k(scaled, batch.top_k)
                if batch.any_top_p:
                    scaled = apply_top_p(scaled, batch.top_p)
                if batch.any_min_p:
                    scaled = apply_min_p(scaled, batch.min_p)
            logits, temperature = scaled, torch.ones_like(temperature)
        sampled_ids = sample_exponential_race(logits, temperature, batch.generators, batch.seeded_rows)
        if greedy_ids is None:
            return sampled_ids
        return torch.where(batch.is_greedy, greedy_ids, sampled_ids)
