"""Logits from final hidden states exactly as a model's own forward computes them, for the architectures
where that is known, so that PALU projects only the positions its losses read.

Most causal LMs end in a plain output projection (tied to the input embeddings or not). Gemma 2, and Gemma 3
where its config asks for it, soft-cap what the projection gives: cap·tanh(z / cap), with
`final_logit_softcapping` (30 by default in Gemma 2). A projection that skipped the cap would hand the local
loss and the KL logits the model never produces. Architectures not listed here may scale or cap their
logits in ways this module does not know: they get full logits from their own forward.
"""

from collections.abc import Callable

import torch

SOFTCAPPED_MODEL_TYPES = ("gemma2", "gemma3_text")
PROJECTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", *SOFTCAPPED_MODEL_TYPES)


def logit_projection(model) -> tuple[Callable[[torch.Tensor], torch.Tensor] | None, str]:
    """(project, why): `project` maps final hidden states (..., d) to the model's logits (..., |V|), or is
    None when this model's logits are not known to be its output projection (`why` says so)."""
    config = model.config
    head = model.get_output_embeddings()
    if config.model_type not in PROJECTED_MODEL_TYPES:
        return None, (
            f"model_type={config.model_type}: its logits may be scaled or capped after the output projection "
            f"(PALU projects at the loss positions only for {', '.join(PROJECTED_MODEL_TYPES)})"
        )
    if not isinstance(head, torch.nn.Linear):
        return None, f"the output embeddings are a {type(head).__name__}, not a linear projection"
    if getattr(config, "pretraining_tp", 1) != 1:
        return None, f"pretraining_tp={config.pretraining_tp} splits the output projection"
    cap = getattr(config, "final_logit_softcapping", None)
    why = f"model_type={config.model_type}: logits are the output projection"
    if cap is None or config.model_type not in SOFTCAPPED_MODEL_TYPES:
        return head, why
    return lambda hidden: torch.tanh(head(hidden) / cap) * cap, f"{why} soft-capped at {cap}"
