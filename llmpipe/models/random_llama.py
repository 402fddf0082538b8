"""A random-weight Llama of a real model's shape, for measuring speed without a download.

The folder holds a config, a generation config, the tiny model's tokenizer and a marker
file, but no weights: the transformers engine sees the marker and builds the model from
the config directly on its device, in its dtype, in seconds (a 13B checkpoint would be 26
GB to write and read back in every worker). Outputs are noise; the cost per token is the
real shape's. The vocabulary is the shape's (32000): prompts use the tiny tokenizer's
first ids, and generated ids past its vocabulary detokenize to nothing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

RANDOM_WEIGHTS_FILE = "llmpipe-random-weights.json"

# name -> (what it is, LlamaConfig fields)
SHAPES: dict[str, tuple[str, dict]] = {
    "13b": ("LLaMA-2-13B shape: 40 layers, hidden 5120, 40 heads, MLP 13824, vocab 32000",
            dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                 num_key_value_heads=40, vocab_size=32000, max_position_embeddings=4096)),
    "1b": ("TinyLlama-1.1B shape: 22 layers, hidden 2048, 32 heads (4 KV), MLP 5632, vocab 32000",
           dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)),
    "tiny": ("tiny shape (CPU rehearsal): 4 layers, hidden 256, 4 heads, MLP 512, vocab 32000",
             dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)),
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def is_random_weights(path: str | Path) -> bool:
    return (Path(path) / RANDOM_WEIGHTS_FILE).is_file()


def parameter_count(shape: str) -> int:
    c = SHAPES[shape][1]
    h, i, n, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = h * c["num_key_value_heads"] // c["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return n * per_layer + 2 * v * h + h


def build_random_llama(dest: Path, shape: str, tokenizer_from: Path, seed: int = 0) -> Path:
    """Write the folder for ``shape`` into ``dest`` (replaced), with the tokenizer of the
    model folder ``tokenizer_from``; returns ``dest``."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig

    about, fields = SHAPES[shape]
    dest = Path(dest)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    if len(tok) > fields["vocab_size"]:
        raise ValueError(f"tokenizer of {tokenizer_from} has {len(tok)} ids, more than the shape's {fields['vocab_size']}")
    for name in _TOKENIZER_FILES:
        if (Path(tokenizer_from) / name).is_file():
            shutil.copy2(Path(tokenizer_from) / name, dest / name)
    eos = [i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if isinstance(i, int)]
    config = LlamaConfig(**fields, bos_token_id=tok.bos_token_id, eos_token_id=eos[0], pad_token_id=tok.pad_token_id,
                         rms_norm_eps=1e-5, rope_theta=10000.0, initializer_range=0.02, tie_word_embeddings=False,
                         hidden_act="silu")
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(dest)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=eos, pad_token_id=tok.pad_token_id).save_pretrained(dest)
    (dest / RANDOM_WEIGHTS_FILE).write_text(json.dumps(
        {"shape": shape, "about": about, "parameters": parameter_count(shape), "seed": seed,
         "note": "no weights: the transformers engine initialises them at random on its device"}, indent=1))
    return dest
