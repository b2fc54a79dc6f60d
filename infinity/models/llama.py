"""The estimator's Llama: a torch-only model with the parameters (names, shapes, module classes) of transformers'
`LlamaForCausalLM` and the same operations in its forward, so that the meta trace saves the same tensors and
counts the same FLOPs.

Note [estimator's Llama]: importing transformers' Llama costs ~3 s of CPU (its config alone pulls
`torch.distributed.tensor` and scipy), and PEFT ~0.5 s more, more than the rest of a 70B estimate; a `[model]`
Llama shape (`model.kind = "llama"`, not pretrained) is estimated with this copy instead, and so is a pretrained
Llama directory whose config.json the copy models (`llama_fields`: model_type "llama", no biases, SiLU, no
attention dropout, no rope scaling, no quantization, head size d / heads, dtype fp32 / fp16 / bf16 as
transformers builds it, tied embeddings when `tie_word_embeddings`), with `[model.lora]` r > 0 wrapped as PEFT
wraps it (`PeftModelForCausalLM`: the same names, the base frozen, fp32 adapters, dropout, the input cast, the
scaling) when its targets are its blocks' linears (`lora_targets`); anything else goes to transformers / PEFT,
and the job's own checks of the directory (vocabulary, positions, the packages installed) are made the same.
It is the estimator's only: the job trains transformers' model. What it must equal is transformers' (and
PEFT's) under the estimate: tests/plan/test_estimate_fast.py holds every figure of the estimate (units, table,
trace, plans, peak) equal to the one of transformers' model, with and without grouped-query attention, and of a
pretrained directory with PEFT's LoRA, so a transformers or PEFT release that changes what they save fails that
test. It covers the default attention (`sdpa`, causal, no mask: the job's batches have no padding) and the
unchunked loss; `[activation] loss_chunk_tokens` (which needs transformers' head) uses transformers' model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class LlamaRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim, self.groups = d // heads, heads // kv_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(d, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, d, bias=False)

    def forward(self, hidden_states, cos, sin):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)
        gqa = {"enable_gqa": True} if self.groups > 1 else {}
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, scale=self.scaling,
                                             is_causal=q.shape[2] > 1, **gqa)
        out = out.transpose(1, 2).contiguous()
        return self.o_proj(out.reshape(*input_shape, -1).contiguous())


class LlamaMLP(nn.Module):
    def __init__(self, d: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, ffn: int, eps: float):
        super().__init__()
        self.self_attn = LlamaAttention(d, heads, kv_heads)
        self.mlp = LlamaMLP(d, ffn)
        self.input_layernorm = LlamaRMSNorm(d, eps)
        self.post_attention_layernorm = LlamaRMSNorm(d, eps)

    def forward(self, hidden_states, *, position_embeddings):  # (cos, sin) by keyword, as transformers passes them
        cos, sin = position_embeddings
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), cos, sin)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaModel(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, kv_heads: int, ffn: int, eps: float,
                 theta: float):
        super().__init__()
        # the weight given: Embedding's own init (normal_) on the meta device imports torch._dynamo (~1.2 s)
        self.embed_tokens = nn.Embedding(vocab, d, _weight=torch.empty(vocab, d))
        self.layers = nn.ModuleList(LlamaDecoderLayer(d, heads, kv_heads, ffn, eps) for _ in range(layers))
        self.norm = LlamaRMSNorm(d, eps)
        dim = d // heads
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)),
                             persistent=False)

    def forward(self, input_ids, use_cache=None):  # (it has no KV cache: transformers' with use_cache=False)
        hidden_states = self.embed_tokens(input_ids)
        position_ids = torch.arange(hidden_states.shape[1], device=hidden_states.device).unsqueeze(0)
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=hidden_states.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos() * 1.0).to(hidden_states.dtype), (emb.sin() * 1.0).to(hidden_states.dtype)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings=(cos, sin))
        return self.norm(hidden_states)


@dataclass
class CausalLMOutput:
    logits: torch.Tensor


class LlamaForCausalLM(nn.Module):
    """transformers' `LlamaForCausalLM` as the estimate sees it (Note [estimator's Llama])."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, kv_heads: int, ffn: int, eps: float = 1e-6,
                 theta: float = 10000.0, tie: bool = False):
        super().__init__()
        self.model = LlamaModel(vocab, d, layers, heads, kv_heads, ffn, eps, theta)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie:  # tie_word_embeddings: transformers' lm_head is the embedding's weight
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, use_cache=None):
        hidden_states = self.model(input_ids)
        return CausalLMOutput(self.lm_head(hidden_states[:, slice(0, None), :]))


# ---------------------------------------------------------------- a pretrained Llama's config.json, LoRA

DTYPES = {None: torch.float32, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# config.json keys whose only values the copy models (absent = transformers' default, the same value)
MODELLED = {"attention_bias": (False,), "mlp_bias": (False,), "hidden_act": ("silu",), "pretraining_tp": (1,),
            "attention_dropout": (0, 0.0), "rope_scaling": (None,), "quantization_config": (None,),
            "layer_types": (None,)}


def llama_fields(hf: dict) -> dict | None:
    """The copy's arguments (and `dtype`) for a pretrained directory's config.json (Note [estimator's Llama]), or
    None when the copy does not model it (not a Llama; biases, another activation, attention dropout, rope
    scaling, quantization, a head size other than d / heads, a dtype it does not know): transformers' model then."""
    ints = [hf.get(k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                "intermediate_size")]
    kv = hf.get("num_key_value_heads") or hf.get("num_attention_heads")
    if hf.get("model_type") != "llama" or not all(isinstance(v, int) and v > 0 for v in [*ints, kv]):
        return None
    vocab, d, layers, heads, ffn = ints
    rope = hf.get("rope_parameters") or {}
    dtype = hf.get("dtype", hf.get("torch_dtype"))
    if (any(hf.get(k, ok[0]) not in ok for k, ok in MODELLED.items()) or rope.get("rope_type", "default") != "default"
            or d % heads or heads % kv or hf.get("head_dim", d // heads) != d // heads or dtype not in DTYPES):
        return None
    return {"vocab": vocab, "d": d, "layers": layers, "heads": heads, "kv_heads": kv, "ffn": ffn,
            "eps": float(hf.get("rms_norm_eps", 1e-6)), "theta": float(rope.get("rope_theta", hf.get("rope_theta",
                                                                                                  10000.0))),
            "tie": bool(hf.get("tie_word_embeddings", False)), "dtype": DTYPES[dtype]}


def copy_sizes(vocab: int, d: int, heads: int, kv_heads: int, ffn: int, r: int = 0) -> dict | None:
    """The copy's sizes as the symbols of its small twin (Note [small twin]): key/value heads, query heads per
    key/value head, half a head (rotary embeddings halve a head), the MLP width, the vocabulary and LoRA's rank
    (absent without LoRA); None when a head is not an even number of elements (the meta trace then)."""
    head = d // heads
    if head % 2:
        return None
    # in the order the twin takes its primes: the smallest where they multiply most (d = kv.groups.2.half_head,
    # then the tokens: batch and sequence, filled in per trace)
    sizes = {"kv": kv_heads, "groups": heads // kv_heads, "half_head": head // 2, "batch": None, "seq": None,
             "ffn": ffn, "vocab": vocab}
    return sizes | ({"r": r} if r else {})


def copy_dims(sizes: dict) -> dict:
    """`copy_sizes` back to the copy's arguments (vocab, d, heads, kv_heads, ffn) and LoRA's rank `r`."""
    heads = sizes["kv"] * sizes["groups"]
    return {"vocab": sizes["vocab"], "d": heads * 2 * sizes["half_head"], "heads": heads, "kv_heads": sizes["kv"],
            "ffn": sizes["ffn"], "r": sizes.get("r", 0)}


# PEFT's LoRA targets for a Llama ("all-linear": every linear layer but the output head)
LORA_DEFAULT, LORA_LINEAR = ("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj")


def lora_targets(targets: tuple) -> tuple | None:
    """The copy's linear layers `[model.lora] targets` adapts as PEFT resolves them for a Llama, or None when the
    copy does not resolve them (anything but leaf names of its blocks' linears, or PEFT's shorthand): PEFT then."""
    if not targets:
        return LORA_DEFAULT
    if tuple(targets) == ("all-linear",):
        return LORA_LINEAR
    return tuple(targets) if all(t in LORA_LINEAR for t in targets) else None


class LoraLinear(nn.Module):
    """PEFT's `lora.Linear` (one adapter, "default") as the estimate sees it: the base layer, dropout (Identity at
    p = 0), A and B in fp32 (PEFT's autocast_adapter_dtype), the input cast to A's dtype, scaled, cast back."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float):
        super().__init__()
        self.base_layer = base
        self.lora_dropout = nn.ModuleDict({"default": nn.Dropout(p=dropout) if dropout > 0.0 else nn.Identity()})
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False, dtype=torch.float32)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False, dtype=torch.float32)})
        self.lora_embedding_A, self.lora_embedding_B = nn.ParameterDict(), nn.ParameterDict()
        self.lora_magnitude_vector = nn.ModuleDict()
        self.scaling = alpha / r
        base.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        torch_result_dtype = result.dtype
        lora_A = self.lora_A["default"]
        if x.dtype != lora_A.weight.dtype:
            x = x.to(lora_A.weight.dtype)
        result = result + self.lora_B["default"](lora_A(self.lora_dropout["default"](x))) * self.scaling
        return result.to(torch_result_dtype)


class LoraModel(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


class PeftModelForCausalLM(nn.Module):
    """PEFT's `get_peft_model(model, LoraConfig(...))` of the copy, as the estimate sees it: the same names
    (base_model.model....), the base frozen, the targets wrapped by LoraLinear."""

    def __init__(self, model: nn.Module, r: int, alpha: float, dropout: float, targets: tuple):
        super().__init__()
        for p in model.parameters():
            p.requires_grad_(False)
        for block in model.model.layers:
            for parent in (block.self_attn, block.mlp):
                for name, child in list(parent.named_children()):
                    if name in targets:
                        setattr(parent, name, LoraLinear(child, r, alpha, dropout))
        self.base_model = LoraModel(model)

    def forward(self, input_ids, use_cache=None):
        return self.base_model(input_ids)
