"""A tiny random-weight Llama with a real tokenizer, built offline and byte-identically.

The tokenizer is a byte-level BPE trained on ``corpus.txt`` (shipped next to this file);
the model is ``LlamaForCausalLM`` initialised from ``torch.manual_seed(0)``. Its outputs are
nonsense, but it has the shape of a real chat model: a chat template, bos/eos/pad tokens, a
context length, safetensors weights. Tests and development engines load it in seconds.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from llmpipe.models._build import build_once, portable_files, quiet_transformers, recipe_key

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]  # ids 0..4, in this order

VOCAB_SIZE = 3072  # the target; a small corpus may yield fewer merges
CONTEXT_LENGTH = 2048

# ChatML, as SmolLM2 uses it (without SmolLM2's default system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

MODEL_CONFIG = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=CONTEXT_LENGTH,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    initializer_range=0.02,
    tie_word_embeddings=False,
    hidden_act="silu",
)

_HERE = Path(__file__).resolve().parent
CORPUS = _HERE / "corpus.txt"


def _recipe(seed: int = 0) -> str:
    versions = [f"{d}=={metadata.version(d)}" for d in ("torch", "transformers", "tokenizers")]
    return recipe_key(
        "tiny-v1" if seed == 0 else f"tiny-v1-seed{seed}",
        CORPUS.read_bytes(),
        Path(__file__).read_bytes(),
        (_HERE / "_build.py").read_bytes(),
        *versions,
    )


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = CORPUS.read_text(encoding="utf-8")
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return tok


def _write(tmp: Path, seed: int = 0) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=CONTEXT_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        **MODEL_CONFIG,
    )
    config.architectures = ["LlamaForCausalLM"]
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS],
        # Stop at the end of text and at the end of a chat turn.
        eos_token_id=[ids[EOS], ids[IM_END]],
        pad_token_id=ids[PAD],
    )
    with quiet_transformers():
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    portable_files(tmp, "float32")


def build_tiny(dest: Path, seed: int = 0) -> Path:
    """Build the tiny test model into ``dest`` (skipped when already built); returns its path.
    ``seed``: another seed gives another model of the same shape and tokenizer (the
    multi-model tests serve two that answer differently)."""
    path, _ = build_once(Path(dest), _recipe(seed), lambda tmp: _write(tmp, seed))
    return path

