"""Conversions between the wire (protos) and engine types, in one place."""

from __future__ import annotations

from shared.engine.request import TokenSample
from shared.engine.sampling_params import InvalidRequestError, SamplingParams
from shared.genproto.cleave.v1 import worker_pb2 as pb
from shared.structured.constraint import Constraint


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, min_tokens=p.min_tokens,
        stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos,
    )  # fmt: skip
    if p.seed is not None:
        msg.seed = p.seed
    if p.max_tokens is not None:
        msg.max_tokens = p.max_tokens
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.constraint is not None:
        msg.constraint.CopyFrom(constraint_to_proto(p.constraint))
    set_token_controls(msg, p)
    return msg


def set_token_controls(msg: pb.SamplingParams, p: SamplingParams) -> None:
    """Copy ``logit_bias``, ``allowed_token_ids``, bad words, prompt logprobs and pooling onto the wire message."""
    for token_id, bias in p.logit_bias.items():
        msg.logit_bias[token_id] = bias
    if p.allowed_token_ids is not None:
        msg.allowed_token_ids.token_ids.extend(p.allowed_token_ids)
    for word in p.bad_words_token_ids:
        msg.bad_words.add(token_ids=word)
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    if p.pooling is not None:
        msg.pooling, msg.normalize = p.pooling, p.normalize
    if p.use_beam_search:
        msg.use_beam_search = True
        msg.length_penalty = p.length_penalty
        msg.early_stopping = {True: "true", False: "", "never": "never"}[p.early_stopping]
    if p.best_of is not None:
        msg.best_of = p.best_of


def constraint_to_proto(c: Constraint) -> pb.OutputConstraint:
    return pb.OutputConstraint(kind=c.kind, spec=c.spec)


def constraint_from_proto(msg: pb.SamplingParams) -> Constraint | None:
    """Raises InvalidRequestError on an unknown kind."""
    if not msg.HasField("constraint"):
        return None
    try:
        return Constraint(msg.constraint.kind, msg.constraint.spec)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Raises InvalidRequestError on invalid values."""
    return SamplingParams(
        n=msg.n or 1, temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k, min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
        min_tokens=msg.min_tokens, stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        logit_bias=dict(msg.logit_bias),
        allowed_token_ids=list(msg.allowed_token_ids.token_ids) if msg.HasField("allowed_token_ids") else None,
        bad_words_token_ids=[list(word.token_ids) for word in msg.bad_words],
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        pooling=msg.pooling or None, normalize=msg.normalize if msg.pooling else True,
        constraint=constraint_from_proto(msg),
        **beam_search_from_proto(msg),
    )  # fmt: skip


def beam_search_from_proto(msg: pb.SamplingParams) -> dict:
    early_stopping = {"": False, "true": True, "never": "never"}.get(msg.early_stopping)
    if early_stopping is None:
        raise InvalidRequestError(f"early_stopping must be true, false or 'never', got {msg.early_stopping!r}")
    return {
        "use_beam_search": msg.use_beam_search,
        "best_of": msg.best_of if msg.HasField("best_of") else None,
        "length_penalty": msg.length_penalty if msg.HasField("length_penalty") else 1.0,
        "early_stopping": early_stopping,
    }


def token_to_proto(sample: TokenSample) -> pb.TokenOutput:
    msg = pb.TokenOutput(
        token_id=sample.token_id,
        logprob=sample.logprob,
        top_logprobs=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in sample.top_logprobs or []],
    )
    if sample.rank is not None:
        msg.rank = sample.rank
    return msg


def token_from_proto(msg: pb.TokenOutput) -> TokenSample:
    return TokenSample(msg.token_id, msg.logprob, [(t.token_id, t.logprob) for t in msg.top_logprobs] or None)
