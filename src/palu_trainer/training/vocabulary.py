"""The tokenizer's vocabulary against the model's: what ids can reach, and the |V| that K is a share of.

Models often pad their vocabulary beyond the tokenizer (to a multiple of 64 or 128: Phi-3's 32064 rows for
32011 tokens, Qwen2's 151936 for 151665, DeepSeek's 102400 for 100015). Those rows are never a target, so
PALU's `top_k` share is taken of the tokenizer's reachable vocabulary, min(len(tokenizer), |V_model|). A
tokenizer with more tokens than the model has rows would index past the embeddings (IndexError at the
first step), and one that reaches less than `MIN_REACHED_SHARE` of them is almost surely another model's.
"""

# Below this share of the model's vocabulary reached by the tokenizer, the tokenizer is taken to be the
# wrong one: padding leaves a few percent of the rows unreached, another model's tokenizer far more.
MIN_REACHED_SHARE = 0.9


def model_vocab_size(model) -> int:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return getattr(embeddings, "num_embeddings", None) or model.config.vocab_size


def reachable_vocab_size(model, tokenizer) -> int:
    """|V| that a share of the vocabulary (`top_k` in (0, 1]) is taken of: the entries tokens can reach."""
    size = model_vocab_size(model)
    return size if tokenizer is None else min(len(tokenizer), size)


def vocabulary_mismatch(tokenizer_size: int, model_size: int, tokenizer_name: str, model_name: str):
    """(error, warning) about a tokenizer of `tokenizer_size` tokens on a model with `model_size` rows."""
    fix = (
        f"use the model's own tokenizer (model.tokenizer_args.pretrained_model_name_or_path={model_name}), "
        "or save the model with embeddings resized to the tokenizer"
    )
    if tokenizer_size > model_size:
        return (
            f"the tokenizer {tokenizer_name} has {tokenizer_size} tokens but the model {model_name} has "
            f"{model_size} vocabulary rows: token ids >= {model_size} would index past its embeddings "
            f"(IndexError at the first step); {fix}",
            None,
        )
    if tokenizer_size < MIN_REACHED_SHARE * model_size:
        return (
            f"the tokenizer {tokenizer_name} has {tokenizer_size} tokens, {tokenizer_size / model_size:.0%} "
            f"of the {model_size} vocabulary rows of the model {model_name}: it is almost surely another "
            f"model's tokenizer (padding leaves a few percent unreached, below {MIN_REACHED_SHARE:.0%} is "
            f"refused); {fix}, or pad the tokenizer with unused tokens up to the model's size",
            None,
        )
    if tokenizer_size < model_size:
        return None, (
            f"the tokenizer {tokenizer_name} has {tokenizer_size} tokens and the model {model_name} "
            f"{model_size} vocabulary rows: {model_size - tokenizer_size} rows no token reaches (padding); "
            f"top_k shares are taken of the tokenizer's {tokenizer_size}"
        )
    return None, None
