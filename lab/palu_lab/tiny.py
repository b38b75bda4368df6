"""Small models made from scratch: a byte-level BPE tokenizer and a causal LM (Llama by default), for tests
and offline demos."""

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

BOS, EOS, PAD = "<s>", "</s>", "<pad>"


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int = 2048, padded_vocab_size: int | None = None
) -> PreTrainedTokenizerFast:
    """Byte-level BPE over `texts`; BOS is prepended on encode, as Llama tokenizers do.

    padded_vocab_size: fill the vocabulary up to this many entries with `<unused_i>` tokens that no merge
    produces, as large real vocabularies carry many tokens a small corpus never uses (|V| = 32000 for a
    model whose loss code must see Llama-2's |V| on a tokenizer trained on TOFU's text).
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if padded_vocab_size is not None:
        tokenizer = with_unused_tokens(tokenizer, padded_vocab_size)
    return as_llama_style(tokenizer)


def with_unused_tokens(tokenizer: Tokenizer, size: int) -> Tokenizer:
    """The same BPE with its vocabulary filled up to `size` entries by tokens that no merge reaches."""
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for index in range(len(vocab), size):
        vocab[f"<unused_{index}>"] = index
    return Tokenizer.from_str(json.dumps(spec))


def as_llama_style(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """A trained `tokenizers` object with BOS prepended on encode and Llama's special tokens."""
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
    )


def make_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    model_type: str = "llama",
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    dtype=None,
    device: str | None = None,
    **config_overrides,
):
    """A randomly initialised causal LM of `model_type` (llama, qwen3, gemma2, gemma3_text, …: any the
    installed transformers knows) sized to the tokenizer's vocabulary; tied output embeddings as
    Llama-3.2-1B, SmolLM2 and Gemma, untied as Llama-2-7B. Key-value heads as many as query heads and an
    MLP 4 x hidden unless given; `dtype` of the weights (fp32 unless given); `device` to initialise them on
    (the CPU unless given: an 8B model's random init takes minutes there, a second on a GPU);
    `config_overrides` go to its config."""
    import torch

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tie_word_embeddings,
        **config_overrides,
    )
    with torch.device(device or "cpu"):
        return AutoModelForCausalLM.from_config(config, torch_dtype=dtype)


def save_tiny_model(
    directory: str | Path,
    texts: Iterable[str],
    vocab_size: int = 2048,
    padded_vocab_size: int | None = None,
    **model_kwargs,
) -> Path:
    """Train a tokenizer on `texts` (see `train_bpe_tokenizer`), build a model for it (a Llama unless
    `model_type` says otherwise) and save both with save_pretrained."""
    directory = Path(directory)
    tokenizer = train_bpe_tokenizer(texts, vocab_size, padded_vocab_size)
    make_tiny_model(tokenizer, **model_kwargs).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
