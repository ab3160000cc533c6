"""ModelFamily: what a model family declares (see the files in `families/`).

A family says how an HF config becomes a ModelSpec (`spec`), its canonical tensors layer by layer (`layer`,
`head`, `tail`: `Entry`s with a shared `Role` or the family's own `cuts.TensorKind`), what refits leave out
(`excluded`, `stream_extras`), the megatron-core options it implies (`megatron_options`, `megatron_block`,
`from_megatron`) and the vLLM parameters that hold no weights (`vllm_not_weights`)."""
from __future__ import annotations

import abc
import functools
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

from ..errors import ModelConfigError
from ..limits import MAX_DIM, MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, check_limit
from .hf_config import get_bool, get_int, get_str
from .model import LAYER, Entry, Experts, FusedExperts, ModelSpec, Role

_HF_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "fp8": "float8_e4m3fn"}


@dataclass(frozen=True)
class StreamExtra:
    """Tensors an exporter may stream beside the model's that a refit skips (logged once per kind, never refused).

    Attributes:
        what: the kind, in words, with who streams it.
        pattern: a regular expression a name matches whole; its group `layer`, if any, must lie in `layers`.
        layers: [first, stop) of the `layer` group (None: any layer).
    """

    what: str
    pattern: str
    layers: tuple[int, int] | None = None

    def matches(self, name: str) -> bool:
        """Whether the stream item `name` is one of these."""
        m = re.fullmatch(self.pattern, name)
        if m is None:
            return False
        layer = m.groupdict().get("layer")
        return self.layers is None or layer is None or self.layers[0] <= int(layer) < self.layers[1]


class ModelFamily(abc.ABC):
    """A family: its config keys, its canonical tensors and their kinds, and its engine specifics."""

    name: ClassVar[str]
    architectures: ClassVar[tuple[str, ...]]
    model_types: ClassVar[tuple[str, ...]] = ()
    megatron_block: ClassVar[str] = "gpt"  # the layer specs the CPU validation builds ("gpt", "gated_delta_net")
    megatron_config_class: ClassVar[str] = "TransformerConfig"
    vllm_not_weights: ClassVar[tuple[str, ...]] = ()  # live vLLM parameters that hold no weights (`{i}`: layer)
    fp8_router: ClassVar[bool] = True  # whether an FP8 vLLM engine quantizes the MoE router

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "spec" in cls.__dict__ and not getattr(cls.__dict__["spec"], "generic_rules", False):
            cls.spec = _with_generic_rules(cls.__dict__["spec"])  # every family, a plugin's too

    @abc.abstractmethod
    def spec(self, config: dict[str, Any], include_mtp: bool = False) -> ModelSpec:
        """The spec of an HF config. The generic rules (`check_generic_rules`) run around every family's own."""

    def language_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The fields of the language model (a multimodal wrapper nests them): where the generic rules look."""
        return config

    @abc.abstractmethod
    def layer(self, spec: ModelSpec, i: int) -> Sequence[Entry | Experts]:
        """Layer i's tensors in checkpoint order (names keep `{i}`: layers of one structure share a list)."""

    def hf_model(self, spec: ModelSpec) -> str:
        """The HF prefix of the decoder's tensors (a multimodal wrapper nests the language model deeper)."""
        return "model."

    def head(self, spec: ModelSpec) -> Sequence[Entry]:
        """The tensors before the layers."""
        return [Entry(self.hf_model(spec) + "embed_tokens.weight", (spec.vocab_size, spec.hidden_size), Role.EMBED)]

    def tail(self, spec: ModelSpec) -> Sequence[Entry]:
        """The tensors after the layers: the final norm, and the output layer unless it is tied."""
        out = [Entry(self.hf_model(spec) + "norm.weight", (spec.hidden_size,), Role.FINAL_NORM)]
        if not spec.tie_word_embeddings:
            out.append(Entry("lm_head.weight", (spec.vocab_size, spec.hidden_size), Role.LM_HEAD))
        return out

    def excluded(self, config: dict[str, Any]) -> list[str]:
        """What the HF checkpoint holds that a refit leaves out, in words (empty: nothing)."""
        return []

    def stream_extras(self, spec: ModelSpec) -> tuple[StreamExtra, ...]:
        """What exporters stream beside this model's tensors that refits skip (a family adds its own)."""
        layers = (0, spec.num_layers)
        out = (StreamExtra("FP8 KV-cache / Q scales (NeMo-RL's Megatron stream, kv_cache_dtype fp8)",
                           r"model\.layers\.(?P<layer>\d+)\.self_attn\.(attn\.q_scale|k_scale|v_scale)", layers),
               StreamExtra("Eagle draft-model tensors draft.* (NeMo-RL's Megatron stream with a draft model)",
                           r"draft\..+"),
               StreamExtra("rotary inv_freq buffers (Megatron-Bridge passes on the checkpoint's)",
                           re.escape(self.hf_model(spec)) + r"layers\.(?P<layer>\d+)\.self_attn\.rotary_emb\.inv_freq",
                           layers))
        if spec.tie_word_embeddings:
            out += (StreamExtra("lm_head.weight of tied embeddings (Megatron-Bridge exports a copy of embed_tokens)",
                                r"lm_head\.weight"),)
        return out

    def from_megatron(self, config: Any) -> bool:
        """Whether a megatron-core TransformerConfig alone gives this family's spec (`spec_from_megatron`)."""
        return False

    def megatron_options(self, spec: ModelSpec) -> dict[str, Any]:
        """megatron-core TransformerConfig options this spec implies beyond the shared ones (`reshard validate`)."""
        return {}

    # sizes of a tiny instance of the same structure (validation builds it on CPU)
    TINY: ClassVar[dict[str, Any]] = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
                                      "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 128}

    def tiny_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The same family and structure at toy sizes: at most 4 layers, 64 wide, 4 experts."""
        out = {k: v for k, v in config.items() if k not in ("quantization_config", "auto_map")}
        out.update(self.TINY)
        out["num_hidden_layers"] = min(config.get("num_hidden_layers", 4), 4)
        heads = config.get("num_attention_heads", 4)
        out["num_key_value_heads"] = 4 if (config.get("num_key_value_heads") or heads) == heads else 2  # MHA vs GQA
        out.update({k: v for k, v in (("num_experts", 4), ("n_routed_experts", 4), ("num_local_experts", 4),
                                      ("moe_intermediate_size", 32), ("num_experts_per_tok", 2)) if config.get(k)})
        out["torch_dtype"] = "float32"
        return out

    @staticmethod
    def _refuse_mtp(config: dict[str, Any], include_mtp: bool, mtp_key: str, mtp_names: str) -> None:
        """What no family supports yet: multi-token-prediction layers asked for."""
        mtp = get_int(config, mtp_key, 0, minimum=0, maximum=MAX_LAYERS, null_is_default=True, what="layers")
        if include_mtp and mtp:
            raise ModelConfigError(field=mtp_key, value=mtp, rule=f"asks for multi-token-prediction layers "
                                   f"({mtp_names}), which are not supported yet: Megatron keeps them in a separate mtp "
                                   "block and vLLM in a separate draft model; refit without them")

    def _common(self, config: dict[str, Any], qk_norm: bool, biases: tuple[str, ...] = ("attention_bias", "mlp_bias")
                ) -> dict[str, Any]:
        """The fields every family reads, each strictly typed and bounded (layouts.hf_config)."""
        hidden = get_int(config, "hidden_size")
        layers = get_int(config, "num_hidden_layers", maximum=MAX_LAYERS, what="layers")
        heads = get_int(config, "num_attention_heads", maximum=MAX_HEADS, what="heads")
        vocab = get_int(config, "vocab_size")
        kv = get_int(config, "num_key_value_heads", heads, maximum=MAX_HEADS, null_is_default=True, what="heads")
        head_dim = get_int(config, "head_dim", hidden // heads, null_is_default=True)
        check_limit("num_attention_heads * head_dim", heads * head_dim, MAX_DIM, "a dimension", "model config")
        key = "torch_dtype" if config.get("torch_dtype") is not None else "dtype"
        dtype = get_str(config, key, "bfloat16", choices=sorted(_HF_DTYPES), null_is_default=True)
        for flag in biases:
            if get_bool(config, flag, False, null_is_default=True):
                raise ModelConfigError(field=flag, value=True, rule=f"is not supported (the {self.name} family "
                                       f"has no biases)")
        quant = config.get("quantization_config")
        fp8_blocks = isinstance(quant, dict) and quant.get("quant_method") == "fp8" and \
            quant.get("weight_block_size") is not None
        if quant is not None and not fp8_blocks:  # FP8 blocks: the spec is the model's own; layouts.fp8 the rest
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
            raise ModelConfigError(field="quantization_config", value=method,
                                   rule=f"makes it a quantized checkpoint, which is not supported: refits write "
                                        f"{dtype} weights or FP8 blocks (quant_method fp8 with weight_block_size, "
                                        f"`--fp8`); drop quantization_config and serve the {dtype} weights")
        return dict(family=self.name, hidden_size=hidden, num_layers=layers, num_attention_heads=heads,
                    num_key_value_heads=kv, head_dim=head_dim, vocab_size=vocab, qk_norm=qk_norm,
                    intermediate_size=get_int(config, "intermediate_size", 0, minimum=0, null_is_default=True),
                    tie_word_embeddings=get_bool(config, "tie_word_embeddings", False, null_is_default=True),
                    dtype=_HF_DTYPES[dtype])


def check_generic_rules(config: dict[str, Any]) -> None:
    """Before a family reads its own keys: what no family may accept (each a ModelConfigError naming the key)."""
    act = get_str(config, "hidden_act", "silu", null_is_default=True)
    if act != "silu":
        raise ModelConfigError(field="hidden_act", value=act, rule="is not supported (silu only: the gated MLPs of "
                               "every family are SwiGLU)")
    if config.get("head_dim") is None and "hidden_size" in config and "num_attention_heads" in config:
        hidden = get_int(config, "hidden_size")
        heads = get_int(config, "num_attention_heads", maximum=MAX_HEADS, what="heads")
        if hidden % heads:
            raise ModelConfigError(field="hidden_size", value=hidden, rule=f"is not a multiple of "
                                   f"num_attention_heads={heads} and no head_dim is given (the head width would "
                                   f"be hidden_size / heads)")


def _with_generic_rules(spec: Any) -> Any:
    @functools.wraps(spec)
    def checked(self: ModelFamily, config: dict[str, Any], include_mtp: bool = False) -> ModelSpec:
        language = self.language_config(config)
        check_generic_rules(language)
        out = spec(self, config, include_mtp)
        topk = get_int(language, "num_experts_per_tok", None, null_is_default=True, maximum=MAX_EXPERTS,
                       what="experts") if out.is_moe else None
        if topk is not None and topk > out.num_experts:  # MoE top-k within the routed experts
            raise ModelConfigError(field="num_experts_per_tok", value=topk,
                                   rule=f"is more than the routed experts (num_experts={out.num_experts})")
        return out

    checked.generic_rules = True  # type: ignore[attr-defined]
    return checked


def norm(name: str, size: int, role: Any, p: str = LAYER) -> Entry:
    """A 1-D norm weight `p + name` of `size` elements."""
    return Entry(p + name, (size,), role)


def gqa_attention(spec: ModelSpec, p: str = LAYER, qkv: Sequence[Any] = (Role.Q, Role.K, Role.V),
                  gated: bool = False) -> list[Entry]:
    """q/k/v/o projections (+ per-head q/k norms when the spec has them), q/k/v of the roles `qkv`; `gated`: q_proj
    holds [q_h; gate_h] per head (Qwen3.5's output gate)."""
    H, d, a = spec.hidden_size, spec.head_dim, p + "self_attn."
    out = [Entry(a + "q_proj.weight", ((1 + gated) * spec.num_attention_heads * d, H), qkv[0]),
           Entry(a + "k_proj.weight", (spec.num_key_value_heads * d, H), qkv[1]),
           Entry(a + "v_proj.weight", (spec.num_key_value_heads * d, H), qkv[2]),
           Entry(a + "o_proj.weight", (H, spec.num_attention_heads * d), Role.O)]
    if spec.qk_norm:
        out += [Entry(a + "q_norm.weight", (d,), Role.Q_NORM), Entry(a + "k_norm.weight", (d,), Role.K_NORM)]
    return out


def dense_mlp(spec: ModelSpec, p: str = LAYER) -> list[Entry]:
    """The gate/up/down projections of a dense MLP."""
    return gated_mlp_entries(p + "mlp.", spec.intermediate_size, spec.hidden_size, (Role.GATE, Role.UP, Role.DOWN))


def gated_mlp_entries(m: str, F: int, H: int, roles: Sequence[Any]) -> list[Entry]:
    """`m` + gate_proj / up_proj [F, H] and down_proj [H, F], with `roles`."""
    return [Entry(m + "gate_proj.weight", (F, H), roles[0]), Entry(m + "up_proj.weight", (F, H), roles[1]),
            Entry(m + "down_proj.weight", (H, F), roles[2])]


def routed_experts(spec: ModelSpec, p: str = LAYER) -> list[Entry | Experts]:
    """The router and the per-expert gate/up/down projections (HF per-expert names), with transformers 5's fused
    form `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I] (its conversion_mapping.py)."""
    H, Fm, m = spec.hidden_size, spec.moe_intermediate_size, p + "mlp."
    e = m + "experts.{e}."
    return [Entry(m + "gate.weight", (spec.num_experts, H), Role.ROUTER),
            Experts((Entry(e + "gate_proj.weight", (Fm, H), Role.EXPERT_GATE),
                     Entry(e + "up_proj.weight", (Fm, H), Role.EXPERT_UP),
                     Entry(e + "down_proj.weight", (H, Fm), Role.EXPERT_DOWN)), spec.num_experts,
                    fused=(FusedExperts(m + "experts.gate_up_proj", (0, 1)),
                           FusedExperts(m + "experts.down_proj", (2,))))]


def attention_layer(spec: ModelSpec, mlp: Sequence[Entry | Experts], p: str = LAYER) -> list[Entry | Experts]:
    """Norm, GQA attention, norm, then `mlp`'s tensors: the decoder layer of Qwen3 and Llama."""
    H = spec.hidden_size
    return [norm("input_layernorm.weight", H, Role.INPUT_NORM, p), *gqa_attention(spec, p),
            norm("post_attention_layernorm.weight", H, Role.POST_ATTN_NORM, p), *mlp]
