"""Invalid inputs drawn from the grammar of valid ones, for the fuzz tests of every input surface.

Each surface is described by what a valid input is: an HF config (per family, its keys with a type and a
range), a layout string (`kind:key=value,...` with each option's type and range), a saved plan (its header's
entries and integer arrays), an executor call (a plan and per-rank tensors of given shapes and dtypes) and a
command line (`reshard plan` with its flags' types). Strategies draw a valid input and then break exactly one
rule of that grammar (a type, a range, a required part, a repeated part, the document's encoding or
structure), so every draw is invalid and says which field is to blame: `(input, field)`.
"""
from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from reshard.limits import MAX_DIM, MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_RANKS

# --- HF configs --------------------------------------------------------------------------------------------

INT, BOOL, STR = "int", "bool", "str"
# key -> (type, minimum, maximum, required); minimum 0 where 0 means something (no intermediate size)
COMMON = {
    "hidden_size": (INT, 1, MAX_DIM, True), "num_hidden_layers": (INT, 1, MAX_LAYERS, True),
    "num_attention_heads": (INT, 1, MAX_HEADS, True), "vocab_size": (INT, 1, MAX_DIM, True),
    "num_key_value_heads": (INT, 1, MAX_HEADS, False), "head_dim": (INT, 1, MAX_DIM, False),
    "intermediate_size": (INT, 0, MAX_DIM, False), "tie_word_embeddings": (BOOL, 0, 0, False),
    "torch_dtype": (STR, 0, 0, False),
}
FAMILY_KEYS = {
    "qwen3": {},
    "llama": {},
    "qwen3_moe": {"num_experts": (INT, 1, MAX_EXPERTS, True), "moe_intermediate_size": (INT, 1, MAX_DIM, True),
                  "decoder_sparse_step": (INT, 1, MAX_LAYERS, False)},
    "deepseek_v3": {"kv_lora_rank": (INT, 1, MAX_DIM, True), "qk_nope_head_dim": (INT, 1, MAX_DIM, True),
                    "qk_rope_head_dim": (INT, 1, MAX_DIM, True), "v_head_dim": (INT, 1, MAX_DIM, True),
                    "n_routed_experts": (INT, 1, MAX_EXPERTS, True), "moe_intermediate_size": (INT, 1, MAX_DIM, True),
                    "first_k_dense_replace": (INT, 0, MAX_LAYERS, False), "topk_method": (STR, 0, 0, True)},
}
ARCH = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
        "deepseek_v3": "DeepseekV3ForCausalLM"}


@st.composite
def valid_configs(draw: Any, family: str | None = None) -> dict[str, Any]:
    """A small valid HF config of a registered family."""
    family = family or draw(st.sampled_from(sorted(ARCH)))
    g = draw(st.sampled_from([1, 2, 4]))
    heads = g * draw(st.sampled_from([1, 2]))
    c: dict[str, Any] = {"architectures": [ARCH[family]], "hidden_size": draw(st.sampled_from([16, 32, 64])),
                         "num_hidden_layers": draw(st.integers(1, 4)), "num_attention_heads": heads,
                         "num_key_value_heads": g, "head_dim": draw(st.sampled_from([4, 8])),
                         "intermediate_size": draw(st.sampled_from([16, 32])), "vocab_size": draw(st.integers(8, 200)),
                         "tie_word_embeddings": draw(st.booleans()), "torch_dtype": "bfloat16"}
    if family == "qwen3_moe":
        c.update(num_experts=draw(st.sampled_from([2, 4])), moe_intermediate_size=8, decoder_sparse_step=1)
    if family == "deepseek_v3":
        c.update(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, n_routed_experts=4,
                 moe_intermediate_size=8, first_k_dense_replace=draw(st.integers(0, 1)), topk_method="noaux_tc",
                 q_lora_rank=None)
    return c


def wrong_type(kind: str) -> st.SearchStrategy:
    """JSON values of any type but `kind` (no coercion is accepted: "64", 64.0, true are not integers)."""
    ints = st.integers(-3, 300)
    others = {
        INT: st.one_of(ints.map(str), ints.map(float), st.booleans(), st.lists(ints, max_size=2),
                       st.dictionaries(st.text(max_size=3), ints, max_size=1)),
        BOOL: st.one_of(st.sampled_from(["no", "yes", "true", "false", ""]), ints, st.just(0.0), st.lists(ints,
                                                                                                        max_size=1)),
        STR: st.one_of(ints, st.booleans(), st.lists(st.text(max_size=3), max_size=2)),
    }
    return others[kind]


@st.composite
def invalid_configs(draw: Any) -> tuple[dict[str, Any], str]:
    """(config, the key to blame): one key of a valid config given a wrong type, an out-of-range value, null
    where null is not allowed, or removed although required."""
    family = draw(st.sampled_from(sorted(ARCH)))
    c = draw(valid_configs(family))
    keys = {**COMMON, **FAMILY_KEYS[family]}
    key = draw(st.sampled_from(sorted(keys)))
    kind, low, high, required = keys[key]
    how = draw(st.sampled_from(["type", "range", "missing"] if required else ["type", "range"]))
    if how == "missing":
        c.pop(key)
    elif how == "type" or kind != INT:
        c[key] = draw(wrong_type(kind)) if kind != STR or key != "torch_dtype" else draw(
            st.one_of(wrong_type(STR), st.sampled_from(["int8", "fp4", ""])))
        if kind == STR and key == "topk_method" and isinstance(c[key], str):
            c[key] = "greedy"
    else:
        c[key] = draw(st.one_of(st.integers(-5, low - 1), st.integers(high + 1, high * 4),
                                st.just(10 ** 18), st.just(-(10 ** 18))))
    return c, key


def config_documents() -> st.SearchStrategy:
    """Raw config files that are not a JSON object of a config: (bytes, what is wrong)."""
    return st.one_of(
        st.just((b"[1, 2, 3]", "JSON object")),
        st.just((b'{"hidden_size": 64, "hidden_size": 32}', "repeats the key")),
        st.just((b'{"hidden_size": NaN}', "NaN")),
        st.just((b"\xff\xfe{}", "UTF-8")),
        st.integers(65, 400).map(lambda d: (b"[" * d + b"]" * d, "nests deeper")),
        st.binary(min_size=1, max_size=40).filter(lambda b: not b.strip().startswith(b"{")).map(
            lambda b: (b, "")),
        st.just((b"", "not valid JSON")),
    )


# --- layout strings and constructors --------------------------------------------------------------------------

LAYOUT_OPTIONS = {  # option -> (type, minimum, maximum)
    "megatron": {"tp": (INT, 1, MAX_RANKS), "pp": (INT, 1, MAX_RANKS), "ep": (INT, 1, MAX_RANKS),
                 "etp": (INT, 1, MAX_RANKS), "world": (INT, 1, MAX_RANKS), "vpp": (INT, 1, MAX_RANKS),
                 "vocab_divisor": (INT, 1, MAX_DIM), "naming": (STR, 0, 0)},
    "vllm": {"tp": (INT, 1, MAX_RANKS), "replicas": (INT, 1, MAX_RANKS), "vocab_padding": (INT, 1, MAX_DIM),
             "expert_parallel": (BOOL, 0, 0)},
    "hf": {"replicas": (INT, 1, MAX_RANKS)},
}
_NOT_INTS = ["abc", "2.0", "1e3", "٣", "²", "0x10", "", "+", "2 2", "nan"]


@st.composite
def invalid_layout_strings(draw: Any) -> tuple[str, str]:
    """(layout string, the option to blame): a valid 'kind:tp=1,...' with one rule broken."""
    kind = draw(st.sampled_from(sorted(LAYOUT_OPTIONS)))
    options = LAYOUT_OPTIONS[kind]
    key = draw(st.sampled_from(sorted(options)))
    typ, low, high = options[key]
    how = draw(st.sampled_from(["value", "range", "twice", "bare", "unknown"]))
    if how == "unknown":
        bad = draw(st.sampled_from(["bogus", "tp2", "TP", "rank", "model"]))
        return f"{kind}:{bad}=1", bad
    if typ == BOOL and how in ("range", "bare"):
        how = "value"
    if typ == STR and how == "range":
        how = "value"
    if how == "twice":
        return f"{kind}:{key}=1,{key}=1", key
    if how == "bare":
        return f"{kind}:{key}", key
    if how == "range":
        value = draw(st.one_of(st.integers(-(10 ** 6), low - 1), st.integers(high + 1, 10 ** 30)))
        return f"{kind}:{key}={value}", key
    value = {INT: st.sampled_from(_NOT_INTS), BOOL: st.sampled_from(["maybe", "2", "tru", ""]),
             STR: st.sampled_from(["bogus", "1", "x y", "é"])}[typ]
    return f"{kind}:{key}={draw(value)}", key


NULLABLE = {"etp", "world"}  # None means "the default" for these


def invalid_constructor_values(typ: str, key: str = "") -> st.SearchStrategy:
    """Python values a layout field of type `typ` refuses (no coercion: "2", 2.0, True are not ints)."""
    if key in NULLABLE:
        return invalid_constructor_values(typ).filter(lambda v: v is not None)
    return {INT: st.one_of(st.integers(1, 8).map(str), st.integers(1, 8).map(float), st.booleans(), st.none(),
                           st.lists(st.integers(1, 4), max_size=2)),
            BOOL: st.one_of(st.sampled_from(["yes", "no", "1"]), st.integers(2, 9), st.none()),
            STR: st.one_of(st.integers(), st.none(), st.sampled_from(["bogus", ""]))}[typ]


__all__ = ["ARCH", "COMMON", "FAMILY_KEYS", "LAYOUT_OPTIONS", "config_documents", "invalid_configs",
           "invalid_constructor_values", "invalid_layout_strings", "valid_configs", "wrong_type"]
