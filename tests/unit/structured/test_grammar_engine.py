"""Structured output in the engine: bitmask application, constrained generation that always
validates (also under preemption by recompute), and unconstrained rows left untouched."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from shared.engine import LLM, SamplingParams
from shared.engine.sampler import apply_token_bitmask
from shared.engine.sampling_params import InvalidRequestError
from shared.structured.constraint import Constraint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "level": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "level"],
}


@pytest.fixture(scope="module")
def llm(checkpoint_factory) -> LLM:
    # Few blocks and a small budget: requests get preempted and recomputed mid-generation.
    return LLM(model=str(checkpoint_factory("llama")), dtype="float32", block_size=4, num_blocks=40,
               max_num_batched_tokens=48, max_num_seqs=8)  # fmt: skip


def reference_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Plain torch: unpack the bits of each constrained row and set forbidden logits to -inf."""
    out = logits.clone()
    for row in rows:
        bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
        allowed = bits.flatten()[: logits.shape[-1]].bool()  # [V]
        out[row] = out[row].masked_fill(~allowed, float("-inf"))
    return out


def test_bitmask_masks_only_constrained_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, 70)  # [B, V]
    bitmask = torch.zeros(4, 3, dtype=torch.int32)  # [B, ceil(70 / 32)]
    allowed = [0, 5, 31, 33, 69]  # bit 31 of a word is the sign bit of int32
    for t in allowed:
        bitmask[1, t // 32] |= 1 << (t % 32) if t % 32 != 31 else -(1 << 31)
    bitmask[3] = torch.randint(-(2**31), 2**31 - 1, (3,), dtype=torch.int32)
    expected = reference_bitmask(logits, bitmask, [1, 3])
    out = apply_token_bitmask(logits.clone(), bitmask, [1, 3])
    assert torch.equal(out, expected)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == allowed


def test_constrained_outputs_validate_under_preemption(llm):
    constraint = Constraint.json_schema(SCHEMA)
    prompts = [f"record number {i} is" for i in range(8)]
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=80, n=2, constraint=constraint)
    before = llm.engine.stats().num_preemptions
    outputs = llm.generate(prompts, params)
    assert llm.engine.stats().num_preemptions > before, "the small KV budget should force preemption"
    for output in outputs:
        for choice in output.outputs:
            assert choice.finish_reason == "stop", choice.text
            jsonschema.validate(json.loads(choice.text), SCHEMA)


def test_regex_choice_grammar_and_length(llm):
    cases = [
        (Constraint("regex", r"[0-9]{3}-[a-c]+"), lambda t: len(t) >= 5 and t[3] == "-"),
        (Constraint.choice(["left", "right", "up down"]), lambda t: t in ("left", "right", "up down")),
        (Constraint("grammar", 'root ::= "<" [a-z]{2} ">"'), lambda t: len(t) == 4 and t[0] == "<"),
    ]
    for constraint, check in cases:
        for out in llm.generate(
            ["pick one:"], SamplingParams(temperature=1.0, seed=2, n=3, max_tokens=30, constraint=constraint)
        ):
            for choice in out.outputs:
                assert check(choice.text), (constraint, choice.text)
    # max_tokens still wins: an unfinished constraint ends with "length".
    out = llm.generate(["x"], SamplingParams(max_tokens=2, constraint=Constraint("regex", "[a-z]{40}")))[0]
    assert out.outputs[0].finish_reason == "length"


def test_unconstrained_rows_identical_beside_constrained(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["the garden was", "a small boat"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    constrained = SamplingParams(temperature=0.0, max_tokens=40, constraint=Constraint.json_schema(SCHEMA))
    mixed = llm.generate(prompts + ["json please"], [plain, plain, constrained])
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    jsonschema.validate(json.loads(mixed[2].outputs[0].text), SCHEMA)


def test_bad_constraints_raise(llm):
    for constraint in [Constraint("regex", "[a-"), Constraint("grammar", "root ::= ("), Constraint("json", "{bad")]:
        with pytest.raises(InvalidRequestError, match="does not compile|not valid JSON"):
            llm.engine.compile_constraint(constraint)


def test_compiled_grammar_is_cached(llm):
    backend = llm.engine.grammar_backend()
    constraint = Constraint.json_schema({"type": "object", "properties": {"q": {"type": "boolean"}}})
    assert not backend.cached(constraint)
    llm.engine.compile_constraint(constraint)
    compiled = backend.num_compiled
    llm.engine.compile_constraint(Constraint.json_schema({"properties": {"q": {"type": "boolean"}}, "type": "object"}))
    assert backend.cached(constraint) and backend.num_compiled == compiled


def test_gguf_model_is_constrained_too(checkpoint_factory, tmp_path):
    from tests.helpers.gguf_files import write_gguf

    path = write_gguf(checkpoint_factory("llama"), tmp_path / "tiny.gguf")
    llm = LLM(model=str(path), dtype="float32", num_blocks=64)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=60, constraint=Constraint.json_schema(SCHEMA))
    choice = llm.generate(["a record:"], params)[0].outputs[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.text), SCHEMA)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"]},
    {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    {"type": "object"},  # json_object: any keys and values
])  # fmt: skip
def test_json_strings_refuse_utf8_spelled_surrogates(schema):
    """Bytes ED A0 80 spell the surrogate U+D800, which no valid UTF-8 holds: decoded, they are three
    U+FFFD, so a string the grammar counted as 6 characters came out 8 long. The JSON grammars refuse
    them and still take any real character, multi-byte ones included."""
    import xgrammar as xgr

    from shared.structured.grammar import json_schema_ebnf

    info = xgr.TokenizerInfo(["a", "<eos>"], stop_token_ids=[1])
    compiled = xgr.GrammarCompiler(info).compile_grammar(json_schema_ebnf(json.dumps(schema)))

    def accepts(text: bytes) -> bool:
        return xgr.GrammarMatcher(compiled).accept_string(text)

    assert accepts('{"name": "oe wé€"'.encode())  # 2- and 3-byte characters: 6 in all
    assert not accepts(b'{"name": "oe w\xed\xa0\x80')
    assert not accepts(b'{"name": "\xed\xbf\xbf')
