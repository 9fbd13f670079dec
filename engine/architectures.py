"""Which decoder architectures the runner serves exactly, and the refusal of the rest.

The runner drives a transformers model through its own KV cache and attention function
(kernels/attention.py), so an architecture is served only if everything it does reaches
that function or lives in the model's own modules. Each served one is compared token for
token with HF ``generate`` in tests/test_architectures.py; any other is refused when it is
loaded, with the reason, rather than served wrong.
"""

from __future__ import annotations

# Architectures (config.model_type) served exactly: each is checked token for token against
# HF generate in tests/test_architectures.py, for every method, at batch 1 and 4. Their
# conventions reach specray as the attention call's kwargs (sliding_window, softcap) or
# live in the model's own modules (biases, rotary variants, embedding scales, learned
# positions), and the runner applies final_logit_softcapping itself. Anything else is
# refused at load: a decoder that was never compared is never served.
SERVED_ARCHITECTURES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3",
    "starcoder2", "gpt2", "gpt_bigcode", "gpt_neox", "opt",
})

_NO_INTERFACE = ("its attention does not go through transformers' AttentionInterface, so specray's "
                 "KV cache and masks never see it")
# Why well-known decoders are refused (the message names the reason).
REFUSED_ARCHITECTURES = {
    "falcon": _NO_INTERFACE + " (and its ALiBi variants add position biases specray does not build)",
    "bloom": _NO_INTERFACE + " (ALiBi position biases)",
    "mpt": _NO_INTERFACE + " (ALiBi position biases)",
    "gptj": _NO_INTERFACE,
    "gpt_neo": _NO_INTERFACE,
    "codegen": _NO_INTERFACE,
    "cohere": "its logits are multiplied by logit_scale after the LM head, which the runner does not apply",
    "granite": "its logits are divided by logits_scaling after the LM head, which the runner does not apply",
    "stablelm": "its decoder does not pass attention kwargs down to the attention function",
    "gpt_oss": "its attention sinks (s_aux) are not implemented by specray's attention",
}

# Rotary types whose frequencies change with the longest position in a forward: exact
# only while every position stays within the original context (then they never switch).
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


class UnsupportedArchitectureError(ValueError):
    """A checkpoint whose architecture (or one of its options) specray cannot serve exactly."""


def check_architecture(config, capacity: int | None = None) -> None:
    """Refuse, naming it, an architecture the runner would not serve token-exactly.

    config: the model's config (its ``model_type`` decides); capacity: the context the
    runner will hold (rotary types that switch frequencies past a length need it).
    """
    model_type = getattr(config, "model_type", None) or type(config).__name__
    name = f"{model_type!r}" + (f" ({', '.join(config.architectures)})" if getattr(config, "architectures", None) else "")
    if model_type not in SERVED_ARCHITECTURES:
        reason = REFUSED_ARCHITECTURES.get(model_type, "it is not one of the architectures checked against "
                                                       "transformers token for token")
        raise UnsupportedArchitectureError(
            f"specray cannot serve architecture {name} exactly: {reason}. "
            f"Served: {', '.join(sorted(SERVED_ARCHITECTURES))}"
        )
    odd = sorted(set(getattr(config, "layer_types", None) or ()) - _LAYER_TYPES)
    if odd:
        raise UnsupportedArchitectureError(f"architecture {name}: layer types {odd} are not served "
                                           f"(only {sorted(_LAYER_TYPES)})")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedArchitectureError(f"architecture {name}: use_bidirectional_attention is not causal decoding")
    rope = getattr(config, "rope_parameters", None) or {}
    ropes = rope.values() if all(isinstance(v, dict) for v in rope.values()) and rope else [rope]
    for params in ropes:
        kind = params.get("rope_type", "default")
        if capacity is None or not any(k in kind for k in _LENGTH_DEPENDENT_ROPE):
            continue
        # transformers grows dynamic frequencies past max_position_embeddings and switches
        # longrope's to the long factors past original_max_position_embeddings.
        limit = getattr(config, "max_position_embeddings", None)
        if kind == "longrope":
            limit = (params.get("original_max_position_embeddings")
                     or getattr(config, "original_max_position_embeddings", None) or limit)
        if limit is None or capacity > limit:
            raise UnsupportedArchitectureError(
                f"architecture {name}: rope_type {kind!r} changes its frequencies past {limit} positions, "
                f"so a context of {capacity} cannot be served exactly; set max_model_len <= {limit}"
            )
