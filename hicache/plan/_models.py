"""Models: embedded presets and HuggingFace config.json reading -> the host pools a rank needs.

Owns which pool families a model architecture needs and their per-rank dimensions (KV heads
split by tensor parallelism, MLA replicated, linear-attention state per request). Facts come
from ../shared/reference/model-presets.json. Pure: data in, layout descriptors out.
"""

from __future__ import annotations

import attrs

from hicache.errors import ConfigError, LayoutError
from hicache.plan import _layouts as layouts  # its classes by attribute: a model loads only its families'
from hicache.plan._layouts import dsa_indexer_pages
from hicache.plan._value import value_class

KV_DTYPES = {
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float32": 4, "fp32": 4,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
KINDS = ("mha", "mla", "mla_dsa", "hybrid_linear", "asymmetric")



@value_class
class ModelSpec:
    """The KV-cache-deciding facts of one model; ``kind`` picks the host pools it needs."""

    name: str
    source: str
    kind: str
    facts: dict = attrs.field(hash=False)

    def get(self, key: str) -> int:
        value = self.facts.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{self.name}: config key {key!r} must be a positive integer, got {value!r}")
        return value


def _mha(L, kv, hd, dtype="bfloat16", **extra):
    return {"num_hidden_layers": L, "num_key_value_heads": kv, "head_dim": hd, "torch_dtype": dtype, **extra}


_MLA = {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}

#: Embedded presets (lowercase model name without org or -Instruct).
PRESETS = {
    "llama-3.1-8b": ModelSpec("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "mha", _mha(32, 8, 128)),
    "llama-3.1-70b": ModelSpec("llama-3.1-70b", "meta-llama/Llama-3.1-70B-Instruct", "mha", _mha(80, 8, 128)),
    "qwen3-32b": ModelSpec("qwen3-32b", "Qwen/Qwen3-32B", "mha", _mha(64, 8, 128)),
    "qwen3-235b-a22b": ModelSpec("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B", "mha", _mha(94, 4, 128)),
    "gpt-oss-120b": ModelSpec("gpt-oss-120b", "openai/gpt-oss-120b", "mha", _mha(36, 8, 64, sliding_layers=18,
                                                                                    sliding_window=128)),
    "deepseek-v3": ModelSpec("deepseek-v3", "deepseek-ai/DeepSeek-V3", "mla", dict(_MLA)),
    "kimi-k2": ModelSpec("kimi-k2", "moonshotai/Kimi-K2-Instruct", "mla", dict(_MLA)),
    "deepseek-v3.2": ModelSpec(
        "deepseek-v3.2", "deepseek-ai/DeepSeek-V3.2-Exp", "mla_dsa", {**_MLA, "index_head_dim": 128}
    ),
    "qwen3-next-80b-a3b": ModelSpec(
        "qwen3-next-80b-a3b", "Qwen/Qwen3-Next-80B-A3B-Instruct", "hybrid_linear",
        _mha(48, 2, 256, full_attention_interval=4, linear_conv_kernel_dim=4,
             linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
             linear_num_value_heads=32),
    ),
    "mimo-v2-flash": ModelSpec(
        "mimo-v2-flash", "XiaomiMiMo/MiMo-V2-Flash", "asymmetric",
        _mha(48, 4, 192, v_head_dim=128, swa_num_key_value_heads=8, swa_head_dim=192,
             swa_v_head_dim=128, full_attention_layers=9),
    ),
}
DEFAULT_MODEL = "llama-3.1-70b"


def _first(config: dict, *keys):
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return None


from hicache.plan._layouts import MAX_LAYERS  # noqa: E402

#: The largest model dimension (layers, heads, widths) a config may give: far above any real
#: model, low enough that planning from a tampered file stays bounded.
MAX_DIMENSION = 1_000_000


def model_from_hf_config(config: dict, *, name: str = "config.json", source: str | None = None) -> ModelSpec:
    """Read a HuggingFace ``config.json`` dict into a `ModelSpec`, naming any missing key
    (``source``: where it was read, default ``name``).

    head_dim absent -> hidden_size / num_attention_heads; MLA keys (kv_lora_rank) -> MLA;
    index keys (index_head_dim) -> DSA indexer too; linear-attention keys -> Mamba-style state.
    """
    if not isinstance(config, dict):
        raise ConfigError(f"{name}: expected a JSON object, got {type(config).__name__}")
    config = config.get("text_config", config) if "num_hidden_layers" not in config else config

    def need(key):
        if config.get(key) is None:
            raise ConfigError(f"{name}: key {key!r} not found (needed for the KV cache size)")
        return _positive(config[key], key)

    def _positive(value, key):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_DIMENSION:
            raise ConfigError(f"{name}: {key} must be a whole number in [1, {MAX_DIMENSION:,}], got {value!r}")
        return value

    if isinstance(config.get("num_hidden_layers"), int) and not isinstance(config["num_hidden_layers"], bool) \
            and config["num_hidden_layers"] > MAX_LAYERS:
        raise ConfigError(f"{name}: num_hidden_layers must be at most {MAX_LAYERS:,}, got {config['num_hidden_layers']:,}")
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim",
                "kv_lora_rank", "qk_rope_head_dim", "index_head_dim"):
        if config.get(key) is not None:
            _positive(config[key], key)
    for key in ("torch_dtype", "dtype"):
        if config.get(key) is not None and not isinstance(config[key], str):
            raise ConfigError(f"{name}: {key} must be a dtype name such as 'bfloat16', got {config[key]!r}")

    facts: dict = {"num_hidden_layers": need("num_hidden_layers")}
    facts["torch_dtype"] = _first(config, "torch_dtype", "dtype") or "bfloat16"
    if config.get("kv_lora_rank") is not None:
        facts.update(kv_lora_rank=need("kv_lora_rank"), qk_rope_head_dim=need("qk_rope_head_dim"))
        kind = "mla"
        if config.get("index_head_dim") is not None:
            facts["index_head_dim"] = config["index_head_dim"]
            kind = "mla_dsa"
        return ModelSpec(name, source or name, kind, facts)
    heads = config.get("num_attention_heads")
    facts["num_key_value_heads"] = _first(config, "num_key_value_heads") or heads or need("num_key_value_heads")
    if config.get("head_dim") is not None:
        facts["head_dim"] = config["head_dim"]
    else:
        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        if hidden % heads:
            raise ConfigError(f"{name}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        facts["head_dim"] = hidden // heads
    kind = "mha"
    sliding = _sliding_layers(config, name)
    if sliding:  # HF's layer_types: SGLang keeps these layers' KV in a window pool of their own
        facts["sliding_layers"] = sliding
        if isinstance(config.get("sliding_window"), int) and not isinstance(config["sliding_window"], bool):
            facts["sliding_window"] = _positive(config["sliding_window"], "sliding_window")
    if config.get("linear_conv_kernel_dim") is not None or config.get("full_attention_interval") is not None:
        kind = "hybrid_linear"
        for key in (
            "full_attention_interval", "linear_conv_kernel_dim", "linear_key_head_dim",
            "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
        ):
            facts[key] = need(key)
    elif config.get("v_head_dim") is not None and config["v_head_dim"] != facts["head_dim"]:
        kind = "asymmetric"
        facts["v_head_dim"] = config["v_head_dim"]
        pattern = config.get("hybrid_layer_pattern")
        if pattern and config.get("swa_num_key_value_heads"):
            facts["full_attention_layers"] = sum(1 for x in pattern if x == 0)
            facts.update(
                swa_num_key_value_heads=config["swa_num_key_value_heads"],
                swa_head_dim=config.get("swa_head_dim", facts["head_dim"]),
                swa_v_head_dim=config.get("swa_v_head_dim", facts["v_head_dim"]),
            )
    return ModelSpec(name, source or name, kind, facts)


def _sliding_layers(config: dict, name: str) -> int:
    """How many of the model's layers HF's ``layer_types`` marks "sliding_attention" (0 without it)."""
    types = config.get("layer_types")
    if types is None:
        return 0
    if not isinstance(types, list) or not all(isinstance(kind, str) for kind in types):
        raise ConfigError(f"{name}: layer_types must be a list of layer type names, got {types!r}")
    return sum(kind == "sliding_attention" for kind in types)


def kv_itemsize(dtype: str) -> int:
    """Bytes per KV element of a dtype name (bf16, fp8, ...)."""
    if dtype not in KV_DTYPES:
        raise ConfigError(f"unknown KV dtype {dtype!r}; known: {', '.join(sorted(KV_DTYPES))}")
    return KV_DTYPES[dtype]


def heads_per_rank(heads: int, tp: int, what: str = "KV heads") -> int:
    """KV heads one rank holds: split by TP, or replicated when TP exceeds the head count."""
    if tp <= heads:
        if heads % tp:
            raise ConfigError(f"{heads} {what} cannot be split over --tp {tp} (not a divisor)")
        return heads // tp
    if tp % heads:
        raise ConfigError(f"--tp {tp} is not a multiple of the {heads} {what}")
    return 1


@value_class
class PoolRecipe:
    """What a model needs per rank: named token pools (per page) and per-request state."""

    token_pools: tuple  # (name, callable(page_num) -> layout)
    state_pools: tuple  # (name, layout)
    notes: tuple[str, ...]


def model_pools(
    model: ModelSpec, *, tp: int, page_size: int, layout: str, itemsize: int, mamba_slots: int,
) -> PoolRecipe:
    """The host pools of ``model`` on one rank, as builders over the page count."""
    L = model.get("num_hidden_layers")
    notes: list[str] = []
    common = dict(page_size=page_size, itemsize=itemsize)
    if model.kind in ("mla", "mla_dsa"):
        C = model.get("kv_lora_rank") + model.get("qk_rope_head_dim")
        notes.append("MLA: the latent cache is replicated on every TP rank (not split by --tp)")
        pools = [("kv", lambda n: layouts.MLALayout(layout, layer_num=L, kv_cache_dim=C, page_num=n, **common))]
        if model.kind == "mla_dsa":
            D = model.get("index_head_dim")
            pools.append(("indexer", lambda n: layouts.DSAIndexerLayout(  # the pages SGLang gives it beside n KV pages
                layout, layer_num=L, index_head_dim=D, page_size=page_size,
                page_num=dsa_indexer_pages(n * page_size, page_size),
            )))
        return PoolRecipe(tuple(pools), (), tuple(notes))
    heads = heads_per_rank(model.get("num_key_value_heads"), tp)
    hd = model.get("head_dim")
    if model.kind == "mha":
        sliding = model.facts.get("sliding_layers")
        if sliding:  # SGLang splits them into a window pool sized by its own device pool: not modelled here
            window = model.facts.get("sliding_window")
            notes.append(f"{sliding} sliding-window layers{f' (window {window})' if window else ''} counted at full "
                         "length in one pool: an upper bound (SGLang keeps them in a window pool of their own)")
        return PoolRecipe(
            (("kv", lambda n: layouts.MHALayout(
                layout, layer_num=L, head_num=heads, head_dim=hd, page_num=n, **common)),),
            (), tuple(notes),
        )
    if model.kind == "asymmetric":
        full = model.facts.get("full_attention_layers", L)
        pools = [("full", lambda n: layouts.AsymmetricMHALayout(
            layout, layer_num=full, head_num=heads, k_head_dim=hd, v_head_dim=model.get("v_head_dim"),
            page_num=n, **common))]
        if full < L:
            swa_heads = heads_per_rank(model.get("swa_num_key_value_heads"), tp, "SWA KV heads")
            pools.append(("swa", lambda n: layouts.AsymmetricMHALayout(
                layout, layer_num=L - full, head_num=swa_heads, k_head_dim=model.get("swa_head_dim"),
                v_head_dim=model.get("swa_v_head_dim"), page_num=n, **common)))
            notes.append(f"{L - full} sliding-window layers counted at full length: an upper bound")
        return PoolRecipe(tuple(pools), (), tuple(notes))
    if model.kind == "hybrid_linear":
        full = L // model.get("full_attention_interval")
        linear = L - full
        v_heads = heads_per_rank(model.get("linear_num_value_heads"), tp, "linear value heads")
        k_heads = heads_per_rank(model.get("linear_num_key_heads"), tp, "linear key heads")
        dk, dv = model.get("linear_key_head_dim"), model.get("linear_value_head_dim")
        conv_dim = 2 * k_heads * dk + v_heads * dv
        state_layout = layout if layout in layouts.MambaLayout.supported() else "page_first"
        if state_layout != layout:
            notes.append(f"linear-attention state has no {layout} layout; planned as page_first")
        notes.append(
            f"{linear} linear-attention layers keep per-request state: {mamba_slots} slots "
            "(--mamba-slots), fp32 SSM state, conv state in the model dtype"
        )
        state = layouts.MambaLayout(
            state_layout, layer_num=linear, slots=mamba_slots, temporal_shape=(v_heads, dk, dv),
            temporal_itemsize=4, conv_shapes=((conv_dim, model.get("linear_conv_kernel_dim") - 1),),
            conv_itemsize=itemsize,
        )
        token = ("kv", lambda n: layouts.MHALayout(
            layout, layer_num=full, head_num=heads, head_dim=hd, page_num=n, **common))
        return PoolRecipe((token,), (("mamba", state),), tuple(notes))
    raise LayoutError(f"unknown model kind {model.kind!r}; known: {', '.join(KINDS)}")
