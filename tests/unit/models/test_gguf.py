"""GGUF loading on tiny files written in the test with ``GGUFWriter``.

Weights must come back as exactly what quantise-then-dequantise makes of the
Hugging Face tensors (so the Q/K un-permutation and name mapping are right),
the tokenizer must encode like the source ``tokenizer.json``, greedy output
must equal transformers' own GGUF loader, and unsupported files must be
refused with a message naming what is unsupported.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from shared.models.config import ModelLoadError, load_model_config
from shared.models.gguf_convert import convert_gguf
from shared.models.loader import load_model
from shared.tokenizer import Tokenizer
from tests.helpers.gguf_files import quant_roundtrip, write_gguf

TEXTS = ["Hello world!", "The quick brown fox, 12345 times.", "  spaces\tand\nnewlines  ", "émoji ✓ ünïcode"]


@pytest.fixture(scope="module")
def llama_dir(checkpoint_factory):
    return checkpoint_factory("llama")


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_1"])
def test_weights_equal_quant_roundtrip_of_hf_tensors(llama_dir, tmp_path, qtype):
    path = write_gguf(llama_dir, tmp_path / f"tiny-{qtype}.gguf", qtype)
    model, config = load_model(path, dtype="float32")
    assert config.architecture == "LlamaForCausalLM" and config.num_kv_heads == 2
    expected = load_file(str(llama_dir / "model.safetensors"))
    loaded = {name: dest for name, dest in model.checkpoint_tensors()}
    assert sorted(loaded) == sorted(expected)
    for name, weights in expected.items():
        np.testing.assert_array_equal(loaded[name].numpy(), quant_roundtrip(weights, qtype), err_msg=name)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_equals_transformers_gguf_loader(checkpoint_factory, tmp_path, arch):
    from transformers import AutoModelForCausalLM

    from shared.engine import LLM, SamplingParams

    # transformers reads no head size from a qwen3 file and assumes 128, so the tiny model uses that.
    model_dir = checkpoint_factory(arch, head_dim=128) if arch == "qwen3" else checkpoint_factory(arch)
    path = write_gguf(model_dir, tmp_path / "tiny.gguf", "Q8_0")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20)
    prompts = [llm.tokenizer.encode(text) for text in TEXTS[:3]]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long))  # fmt: skip
        assert output.outputs[0].token_ids == ref[0, len(prompt) :].tolist()


def test_tokenizer_and_template_from_gguf_match_source(llama_dir, tmp_path):
    from transformers import AutoTokenizer

    path = write_gguf(llama_dir, tmp_path / "tiny.gguf")
    ours, source = Tokenizer.from_dir(path), Tokenizer.from_dir(llama_dir)
    hf = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS:
        assert ours.encode(text) == source.encode(text) == hf(text).input_ids
        assert ours.decode(ours.encode(text)) == text
    messages = [{"role": "user", "content": "Hi there"}]
    assert ours.apply_chat_template(messages) == source.apply_chat_template(messages)
    assert ours.eos_token_id == source.eos_token_id and ours.bos_token_id == source.bos_token_id


def test_convert_gguf_writes_a_loadable_hf_directory(llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    path = write_gguf(llama_dir, tmp_path / "tiny.gguf", "Q4_1")
    out = convert_gguf(path, tmp_path / "converted")
    assert load_model_config(out) == load_model_config(path)
    assert Tokenizer.from_dir(out).encode(TEXTS[1]) == Tokenizer.from_dir(path).encode(TEXTS[1])
    ours, _ = load_model(path, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    hf_state = hf.state_dict()
    for name, dest in ours.checkpoint_tensors():
        torch.testing.assert_close(dest, hf_state[name], rtol=0, atol=0, msg=name)
    with pytest.raises(ModelLoadError, match="not an empty directory"):
        convert_gguf(path, out)


def test_unsupported_tensor_type_is_named(llama_dir, tmp_path):
    from gguf import GGMLQuantizationType, GGUFWriter

    path = tmp_path / "q8k.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    bytes_per_block = 292  # Q8_K: 256 weights per block
    writer.add_tensor("token_embd.weight", np.zeros((4, bytes_per_block), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q8_K)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"token_embd\.weight has type Q8_K"):
        load_model_config(path)


def test_unsupported_architecture_and_tokenizer_are_named(llama_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="architecture 'phi3' is not supported"):
        load_model_config(write_gguf(llama_dir, tmp_path / "phi3.gguf", architecture="phi3"))
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_model_config(tmp_path / "missing.gguf")
    not_gguf = tmp_path / "junk.gguf"
    not_gguf.write_bytes(b"definitely not a gguf file")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model_config(not_gguf)


def test_router_side_reads_gguf_without_torch(llama_dir, tmp_path):
    import subprocess
    import sys

    from tests.integration.cluster import ROOT

    path = write_gguf(llama_dir, tmp_path / "tiny.gguf")
    code = (
        "import sys; from shared.tokenizer import Tokenizer; from shared.models.config import load_model_config; "
        f"t = Tokenizer.from_dir({str(path)!r}); c = load_model_config({str(path)!r}); "
        "assert t.encode('hi') and c.num_layers == 2; assert 'torch' not in sys.modules, 'torch imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def _write_sentencepiece_gguf(path):
    """A sentencepiece-style (``llama``) vocabulary: specials, 256 byte tokens, scored pieces, no merges."""
    from gguf import GGUFWriter

    pieces = ["\u2581", "e", "h", "l", "o", "w", "r", "d", "he", "ll", "llo", "\u2581h", "\u2581he", "\u2581hello",
              "\u2581w", "or", "\u2581wor", "\u2581world", "ld", "\u2581t", "t", "a"]  # fmt: skip
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    path = _write_sentencepiece_gguf(tmp_path / "spm.gguf")
    ours = Tokenizer.from_dir(path)
    hf = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ["hello world", " hello  world", "hat", "héllo ✓", "</s> hello"]:
        ids = ours.encode(text)
        assert ids == hf(text).input_ids, text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
    assert ours.encode("hello")[0] == ours.bos_token_id == 1
