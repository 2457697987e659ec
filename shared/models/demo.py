"""The built-in demo model: a small random-weight Llama with a trained tokenizer.

``make run`` serves this when no model directory is given, so a fresh machine
needs no download. The weights are random (fixed seed), so the text it writes is
noise, but every code path — tokenizer, chat template, paged KV, sampling, KV
transfer — runs exactly as for a real checkpoint.

The tokenizer is a byte-level BPE trained offline on ``shared/data/corpus.txt``.
BOS is prepended by the ``tokenizer.json`` post-processor, so Hugging Face and
``shared.tokenizer.Tokenizer`` agree on encoding without extra config flags.
Chat prompts rendered by the template already start with BOS and are encoded
with ``add_special_tokens=False``, as Hugging Face does.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

CORPUS_PATH = Path(__file__).resolve().parent.parent / "data" / "corpus.txt"

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)  # ids 0..3, in this order

TOKENIZER_VOCAB_SIZE = 4096

# ChatML turns, preceded by BOS; message content may be a string or a list of
# OpenAI-style content parts (only the text parts are rendered).
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- else %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class DemoModelSizes:
    """Geometry of the demo checkpoint (vocab comes from the trained tokenizer)."""

    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    intermediate_size: int = 768
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False


DEMO_MODEL_SIZES = DemoModelSizes()


@lru_cache(maxsize=1)
def demo_tokenizer_json() -> str:
    """Train the demo tokenizer once per process and return its ``tokenizer.json`` text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = CORPUS_PATH.read_text(encoding="utf-8").splitlines()
    tokenizer.train_from_iterator(lines, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer.to_str()


def demo_vocab_size() -> int:
    """Number of ids the demo tokenizer can produce (base vocab plus special tokens)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(demo_tokenizer_json()).get_vocab_size(with_added_tokens=True)


def write_tokenizer_files(model_dir: str | Path, model_max_length: int = 4096) -> dict[str, int]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json``; return the special token ids."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_json = demo_tokenizer_json()
    (model_dir / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    vocab = json.loads(tokenizer_json)["added_tokens"]
    ids = {entry["content"]: entry["id"] for entry in vocab}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "extra_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        "added_tokens_decoder": {
            str(ids[t]): {
                "content": t,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for t in SPECIAL_TOKENS
        },
        "chat_template": CHAT_TEMPLATE,
    }
    with open(model_dir / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(tokenizer_config, f, indent=2, ensure_ascii=False)
    return {t: ids[t] for t in SPECIAL_TOKENS}


def write_generation_config(model_dir: str | Path, special_ids: dict[str, int]) -> None:
    """Stop on end-of-text and on the end of an assistant turn."""
    generation_config = {
        "bos_token_id": special_ids[BOS_TOKEN],
        "eos_token_id": [special_ids[EOS_TOKEN], special_ids[IM_END_TOKEN]],
    }
    with open(Path(model_dir) / "generation_config.json", "w", encoding="utf-8") as f:
        json.dump(generation_config, f, indent=2)


def save_quietly(model, model_dir: str | Path) -> None:
    """``save_pretrained`` without the shard-writing progress bar."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(model_dir)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def write_demo_model(model_dir: str | Path, seed: int = 0) -> Path:
    """Write the demo checkpoint (config, float32 safetensors, tokenizer) into ``model_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = Path(model_dir)
    special_ids = write_tokenizer_files(model_dir, DEMO_MODEL_SIZES.max_position_embeddings)
    config = LlamaConfig(
        vocab_size=demo_vocab_size(),
        **asdict(DEMO_MODEL_SIZES),
        hidden_act="silu",
        bos_token_id=special_ids[BOS_TOKEN],
        eos_token_id=special_ids[EOS_TOKEN],
        dtype="float32",
    )
    # fork_rng keeps the caller's global RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)  # float32, as configured
    save_quietly(model, model_dir)
    write_generation_config(model_dir, special_ids)
    return model_dir
