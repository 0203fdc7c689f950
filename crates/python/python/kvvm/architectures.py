"""Which transformers architectures kvvm can serve, and why not the others.

kvvm holds, per request, one K and one V of ``kv_heads x head_dim`` for every token of every
attention layer (:func:`kvvm.geometry_from_config`), written by the model's forward through
the cache and read back by attention. An architecture whose per-token state is something
else cannot be served, and is refused when the cache, prefix or engine is made, with the
reason, rather than failing inside a forward or giving other tokens:

- an encoder-decoder model, or a decoder with cross-attention layers: those layers attend
  over K/V computed from another input (the encoder's output, an image), a second cache that
  kvvm does not hold;
- multi-head latent attention (DeepSeek V2/V3 and their kin): a token's state is a
  compressed latent and a shared rope key, not per-head K and V;
- K and V of different head dims (``v_head_dim`` != the K head dim): kvvm lays K and V out
  with one head dim;
- layers whose state is not per-token K/V (linear attention, state-space and recurrent
  layers, hybrids of them), sparse or compressed attention, chunked attention;
- layers that reuse another layer's K/V (``num_kv_shared_layers``), and attention shapes
  that differ from layer to layer (a per-layer ``head_dim``).

The engine and :func:`kvvm.attention.use_kvvm_attention` attend with kvvm's own attention
(softmax of scaled ``Q K^T`` over each request's tokens, times ``V``), which also refuses
(``attention=True``):

- a model whose attention does not go through transformers' attention interface (its own
  code, often with ALiBi biases: Bloom, MPT, Falcon, GPT-J, CodeGen), which kvvm's attention
  cannot replace;
- learned attention sinks (GPT-OSS), which kvvm's attention does not compute (it applies
  Gemma 2's attention logit softcapping as the model's own attention does).

Sliding-window attention is decided where the cache lays its layers out (``KvvmCache``).
``docs/models.md`` lists the architectures tried and what each gives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .attention import decoder_config
from .errors import InvalidArgumentError

__all__ = ["check_servable", "refusal_reason"]

#: Layer types whose layers hold per-token K and V.
_KV_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})

#: Why layers of a type hold no per-token K/V kvvm can serve.
_LAYER_TYPE_REASONS = {
    "linear_attention": "linear-attention or state-space layers keep a fixed-size recurrent state, not per-token K/V",
    "conv": "convolution layers keep a convolution state, not per-token K/V",
    "hybrid": "hybrid layers keep a recurrent state beside their K/V",
    "hybrid_sliding": "hybrid layers keep a recurrent state beside their K/V",
    "chunked_attention": "chunked attention (each token attends within its chunk) is not computed by kvvm",
    "deepseek_sparse_attention": "sparse attention layers read an indexed subset of the cached tokens",
    "qwen_sparse_attention": "sparse attention layers read an indexed subset of the cached tokens",
    "compressed_sparse_attention": "compressed attention layers cache compressed blocks, not per-token K/V",
    "heavily_compressed_attention": "compressed attention layers cache compressed blocks, not per-token K/V",
}


def _get(config: Any, name: str) -> Any:
    """``config.name``, or None (also where the config refuses a global read of a per-layer
    attribute)."""
    try:
        return getattr(config, name, None)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError and the like
        return None


def _encoder_decoder(top: Any, dec: Any) -> str | None:
    if _get(top, "is_encoder_decoder") or _get(dec, "is_encoder_decoder"):
        return (
            "an encoder-decoder model: its decoder's cross-attention reads K/V computed from the "
            "encoder's output, a second cache kvvm does not hold"
        )
    return None


def _cross_attention(top: Any, dec: Any) -> str | None:
    layers = _get(dec, "cross_attention_layers")
    if _get(dec, "add_cross_attention") or layers:
        which = f" (layers {list(layers)})" if layers else ""
        return f"cross-attention layers{which} attend over K/V of another input (an image, an encoder), which kvvm does not hold"
    return None


def _latent_attention(top: Any, dec: Any) -> str | None:
    rank = _get(dec, "kv_lora_rank")
    if rank:
        return (
            f"multi-head latent attention: a token's state is a compressed latent of {rank} and a "
            "shared rope key, not per-head K and V"
        )
    return None


def _kv_head_dims(top: Any, dec: Any) -> str | None:
    v = _get(dec, "v_head_dim")
    k = _get(dec, "qk_head_dim") or _get(dec, "head_dim")
    if v is not None and k is not None and int(v) != int(k):
        return f"K and V have different head dims ({k} and {v}); kvvm lays both out with one"
    return None


def _layer_types(top: Any, dec: Any) -> str | None:
    types = _get(dec, "layer_types") or []
    other = sorted(set(types) - _KV_LAYER_TYPES)
    if other:
        reasons = sorted({_LAYER_TYPE_REASONS.get(t, "they hold no per-token K/V kvvm knows") for t in other})
        return f"layer types {other}: " + "; ".join(reasons)
    if _get(dec, "attention_chunk_size") is not None:
        return _LAYER_TYPE_REASONS["chunked_attention"]
    return None


def _shared_or_varying_layers(top: Any, dec: Any) -> str | None:
    shared = _get(dec, "num_kv_shared_layers")
    if shared:
        return f"the last {shared} layers reuse earlier layers' K/V; kvvm holds each layer's own"
    varying = sorted(set(_get(dec, "per_layer_attributes") or ()) & {"head_dim", "num_key_value_heads"})
    if varying:
        verb = "differs" if len(varying) == 1 else "differ"
        return f"{' and '.join(varying)} {verb} from layer to layer; kvvm lays every layer out with one shape"
    return None


def _own_attention(model: Any, dec: Any) -> str | None:
    # transformers' own test of whether a model class's attention goes through the
    # interface (its modeling module's attention layers ask the interface for their function).
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if callable(can_set) and not can_set():
        return (
            "its attention is its own code (often with ALiBi biases), not transformers' attention "
            "interface, so kvvm's attention cannot replace it"
        )
    return None


def _attention_extras(model: Any, dec: Any) -> str | None:
    modules = getattr(model, "modules", None)
    if callable(modules) and any(_get(m, "sinks") is not None for m in modules()):
        return "learned attention sinks, which kvvm's attention does not add"
    return None


_CACHE_RULES: tuple[Callable[[Any, Any], str | None], ...] = (
    _encoder_decoder,
    _cross_attention,
    _latent_attention,
    _kv_head_dims,
    _layer_types,
    _shared_or_varying_layers,
)
_ATTENTION_RULES: tuple[Callable[[Any, Any], str | None], ...] = (_own_attention, _attention_extras)


def refusal_reason(model_or_config: Any, *, attention: bool = False) -> str | None:
    """Why kvvm cannot serve ``model_or_config`` (a transformers model or its config), or
    None when it can. With ``attention``, also what kvvm's own attention (the engine's,
    :func:`~kvvm.attention.use_kvvm_attention`) cannot compute; those checks need the
    model."""
    is_model = hasattr(model_or_config, "config") and callable(getattr(model_or_config, "modules", None))
    top = model_or_config.config if is_model else model_or_config
    dec = decoder_config(top)
    for rule in _CACHE_RULES:
        reason = rule(top, dec)
        if reason:
            return reason
    if attention and is_model:
        for rule in _ATTENTION_RULES:
            reason = rule(model_or_config, dec)
            if reason:
                return reason
    return None


def check_servable(model_or_config: Any, *, attention: bool = False) -> None:
    """Raises :class:`~kvvm.errors.InvalidArgumentError` naming the architecture and
    :func:`refusal_reason` when kvvm cannot serve ``model_or_config``."""
    reason = refusal_reason(model_or_config, attention=attention)
    if reason:
        top = getattr(model_or_config, "config", model_or_config)
        kind = _get(top, "model_type") or type(top).__name__
        raise InvalidArgumentError(f"kvvm cannot serve this {kind} model: {reason}")
