"""Checkpoint loading: sharded indexes, dtypes, and errors that name the file."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.models.config import ModelLoadError
from shared.models.loader import load_model


@pytest.fixture
def llama_dir(checkpoint_factory, tmp_path):
    """A private copy of the tiny llama checkpoint that a test may damage."""
    target = tmp_path / "llama"
    shutil.copytree(checkpoint_factory("llama"), target)
    return target


def edit_config(model_dir, **changes) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def reshard(model_dir, num_shards: int) -> None:
    """Split model.safetensors into shards plus a model.safetensors.index.json, as HF does."""
    tensors = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i in range(num_shards):
        file_name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[i::num_shards]}
        save_file(part, model_dir / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file_name))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_checkpoint_loads_same_weights(llama_dir, checkpoint_factory):
    single, _ = load_model(checkpoint_factory("llama"))
    reshard(llama_dir, 3)
    sharded, config = load_model(llama_dir)
    assert config.architecture == "LlamaForCausalLM"
    for (name, a), (_, b) in zip(single.named_parameters(), sharded.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_dtype_auto_follows_checkpoint_and_can_be_overridden(checkpoint_factory):
    model, _ = load_model(checkpoint_factory("qwen3"))
    assert model.embed_tokens.weight.dtype == torch.float32
    model, _ = load_model(checkpoint_factory("qwen3"), dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope_cos.dtype == torch.float32
    with pytest.raises(ModelLoadError, match="dtype 'int8' is not supported"):
        load_model(checkpoint_factory("qwen3"), dtype="int8")


def test_missing_weights_file_names_directory_and_expected_files(llama_dir):
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(
        ModelLoadError, match=r"no weights found; expected model\.safetensors or model\.safetensors\.index\.json"
    ):
        load_model(llama_dir)


def test_missing_shard_names_the_shard(llama_dir):
    reshard(llama_dir, 2)
    (llama_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors: file not found \(listed in"):
        load_model(llama_dir)


def test_missing_tensor_names_file_and_tensor(llama_dir):
    tensors = load_file(llama_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, llama_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ModelLoadError, match=r"model\.safetensors: missing tensor model\.layers\.1\.mlp\.up_proj\.weight"
    ):
        load_model(llama_dir)


def test_untied_checkpoint_without_lm_head_is_an_error(llama_dir):
    tensors = load_file(llama_dir / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, llama_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="missing tensor lm_head.weight"):
        load_model(llama_dir)


def test_wrong_shape_names_file_tensor_and_both_shapes(llama_dir):
    tensors = load_file(llama_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, llama_dir / "model.safetensors", metadata={"format": "pt"})
    expected = "model.safetensors: tensor model.layers.0.self_attn.q_proj.weight has shape [32, 64], expected [64, 64]"
    with pytest.raises(ModelLoadError, match=re.escape(expected)):
        load_model(llama_dir)


def test_unsupported_architecture_names_config_file(llama_dir):
    edit_config(llama_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match=r"config\.json: architecture 'GPT2LMHeadModel' is not supported"):
        load_model(llama_dir)


@pytest.mark.parametrize("rope_type", ["yarn", "linear", "dynamic"])
def test_unsupported_rope_type_fails_at_load(llama_dir, rope_type):
    edit_config(llama_dir, rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ModelLoadError, match=f"rope type '{rope_type}' is not supported"):
        load_model(llama_dir)


def test_demo_model_loads_and_matches_hf(tmp_path):
    from transformers import AutoModelForCausalLM

    from shared.kernels.torch_ref import TorchAttentionBackend
    from shared.models.demo import DEMO_MODEL_SIZES, write_demo_model
    from shared.tokenizer import Tokenizer
    from tests.helpers.paged import PagedSequences

    model_dir = write_demo_model(tmp_path / "demo")
    model, config = load_model(model_dir)
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (
        DEMO_MODEL_SIZES.hidden_size,
        DEMO_MODEL_SIZES.num_hidden_layers,
        DEMO_MODEL_SIZES.num_attention_heads,
        DEMO_MODEL_SIZES.num_key_value_heads,
    )
    tokenizer = Tokenizer.from_dir(model_dir)
    assert config.vocab_size == tokenizer.vocab_size == 4096
    assert set(config.eos_token_ids) == {tokenizer.eos_token_id, tokenizer.token_to_id("<|im_end|>")}
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Where is the market?"}])
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[0] == tokenizer.bos_token_id
    ours = PagedSequences(model, TorchAttentionBackend(), block_size=16, max_len=len(ids)).step({0: ids})[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
