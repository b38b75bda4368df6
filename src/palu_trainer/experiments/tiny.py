"""Small models made from scratch: a byte-level BPE tokenizer and a Llama, for tests and offline demos."""

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS, EOS, PAD = "<s>", "</s>", "<pad>"


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """Byte-level BPE over `texts`; BOS is prepended on encode, as Llama tokenizers do."""
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
    return as_llama_style(tokenizer)


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


def make_tiny_llama(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A randomly initialised Llama sized to the tokenizer's vocabulary."""
    import torch

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def save_tiny_model(
    directory: str | Path, texts: Iterable[str], vocab_size: int = 2048, **model_kwargs
) -> Path:
    """Train a tokenizer on `texts`, build a Llama for it and save both with save_pretrained."""
    directory = Path(directory)
    tokenizer = train_bpe_tokenizer(texts, vocab_size)
    make_tiny_llama(tokenizer, **model_kwargs).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
