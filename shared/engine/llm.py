"""The offline API: ``LLM(model=DIR).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from shared.config import EngineConfig
from shared.engine.engine_core import EngineCore, RequestOutputDelta
from shared.engine.sampling_params import InvalidRequestError, SamplingParams
from shared.engine.text_output import TextOutput
from shared.tokenizer import Tokenizer


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None  # per token: sampled and top-k ids -> logprob
    cumulative_logprob: float | None = None  # set when logprobs were asked for


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs, vLLM's shape: None for the first token, then id -> logprob.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    embedding: list[float] | None = None  # with SamplingParams.pooling


class _Tracker:
    """Text and token state of one prompt's n completions."""

    def __init__(self, output: RequestOutput, params: SamplingParams, tokenizer: Tokenizer) -> None:
        self.output = output
        self.params = params
        self.texts = [
            TextOutput(tokenizer, output.prompt_token_ids, params.stop, params.skip_special_tokens)
            for _ in range(params.n)
        ]
        self.num_finished = 0

    def add(self, delta: RequestOutputDelta) -> str | None:
        """Apply a step's delta; returns a request id to abort when a stop string was hit."""
        completion = self.output.outputs[delta.sample_index]
        text = self.texts[delta.sample_index]
        if delta.embedding is not None:
            self.output.embedding = delta.embedding
        if delta.prompt_logprobs is not None and self.output.prompt_logprobs is None:
            self.output.prompt_logprobs = [None] + [
                {s.token_id: s.logprob} | dict(s.top_logprobs or []) for s in delta.prompt_logprobs
            ]
        for sample in delta.new_samples:
            completion.token_ids.append(sample.token_id)
            if self.params.logprobs is not None:
                completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + sample.logprob
                entry = {sample.token_id: sample.logprob}
                entry.update(sample.top_logprobs or [])
                assert completion.logprobs is not None
                completion.logprobs.append(entry)
            # A stop token (EOS or a stop id) ends the text without appearing in it.
            ends_on_stop_token = delta.finish_reason == "stop" and sample is delta.new_samples[-1]
            if self.params.detokenize and not ends_on_stop_token:
                text.add(sample.token_id)
        to_abort = None
        if text.stopped and not delta.finished:
            completion.finish_reason = "stop"
            to_abort = delta.request_id
        if delta.finished or to_abort:
            if not delta.finished or completion.finish_reason is None:
                completion.finish_reason = "stop" if text.stopped else delta.finish_reason
            if self.params.detokenize:
                text.finish()
                completion.text = text.text
            self.num_finished += 1
            self.output.num_cached_tokens = max(self.output.num_cached_tokens, delta.num_cached_tokens)
            self.output.finished = self.num_finished == self.params.n
        return to_abort


class LLM:
    """Offline batched generation on one engine, familiar to vLLM users."""

    def __init__(self, model: str, dtype: str = "auto", **engine_kwargs) -> None:
        self.engine = EngineCore(EngineConfig(model=model, dtype=dtype, **engine_kwargs))
        self.tokenizer = Tokenizer.from_dir(model)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        prompt_list = self._normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise InvalidRequestError(
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts; pass one or one per prompt"
                )
        trackers: dict[str, _Tracker] = {}
        order: list[str] = []
        # Validate everything before queueing anything, so a bad prompt leaves the engine untouched.
        prepared = [self._prepare(p, sp) for p, sp in zip(prompt_list, params_list, strict=True)]
        for (text, token_ids), params in zip(prepared, params_list, strict=True):
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, token_ids, replace(params))
            output = RequestOutput(
                request_id,
                text,
                token_ids,
                [CompletionOutput(i, logprobs=[] if params.logprobs is not None else None) for i in range(params.n)],
            )
            trackers[request_id] = _Tracker(output, params, self.tokenizer)
            order.append(request_id)
        self._run(trackers, use_tqdm)
        return [trackers[rid].output for rid in order]

    def _normalize_prompts(self, prompts) -> list[str | list[int]]:
        if isinstance(prompts, str):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]
        return [p if isinstance(p, str) else list(p) for p in prompts]

    def _prepare(self, prompt: str | list[int], params: SamplingParams) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt) if prompt else []
            text: str | None = prompt
        else:
            token_ids, text = prompt, None
        self.engine.validate(token_ids, params)
        return text, token_ids

    def _run(self, trackers: dict[str, _Tracker], use_tqdm: bool) -> None:
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(trackers), desc="generating", unit="req")
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                tracker = trackers[delta.parent_request_id or delta.request_id]
                was_finished = tracker.output.finished
                to_abort = tracker.add(delta)
                if to_abort:
                    self.engine.abort(to_abort)
                if progress is not None and tracker.output.finished and not was_finished:
                    progress.update(1)
        if progress is not None:
            progress.close()
