"""The models the job builds: the built-in GPT, a transformers GPT-2 / Llama of the [model] shape, or a pretrained
Hugging Face directory (LoRA-wrapped with [model.lora] r > 0) on the meta device, with how to initialize it and
how to get its loss from a batch (Note [fine-tuning job] in spec.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from infinity.config.job import VOCAB_SIZE, LoraConfig, ModelConfig
from infinity.config.options import ConfigError, show
from infinity.runtime.chunked_loss import token_loss


@dataclass
class ModelBundle:
    """A model on the meta device, how to initialize it, and how to get its loss from a batch."""

    model: nn.Module
    init_fn: Callable[[nn.Module], None] | None
    loss: Callable[..., torch.Tensor]  # loss(forward, x, y, num_items=None): mean, or the sum over num_items
    description: str
    weights: str | None = None  # initialize(weights=...): the pretrained directory
    hf_config: Any = None  # the transformers config, saved beside an export (pretrained models)


def without_cache(x: torch.Tensor) -> dict:
    """The keyword a Hugging Face causal LM's training forward takes: no KV cache (training reads none, and with one
    each layer's cache entry is in its guards, so compiled units compile a graph per layer up to dynamo's limit of
    8: docs/compile.md). Not on meta tensors: the estimate's trace (Note [small twin]) keeps transformers' cached
    path, because without a cache transformers looks for packed sequences in the position ids with `.all()`, which
    a meta tensor cannot answer; the cache saves no tensor more for backward (the estimator's Llama, which has
    none, traces as transformers' with one: tests/plan/test_estimate_fast.py)."""
    return {} if x.is_meta else {"use_cache": False}


def _lm_loss(forward, x: torch.Tensor, y: torch.Tensor, num_items: int | None = None) -> torch.Tensor:
    """Loss of a Hugging Face causal LM: transformers' ForCausalLMLoss of its logits against the next tokens, or
    their sum over `num_items` (Note [token-weighted windows]); with `[activation] loss_chunk_tokens` the engine
    computes it chunked, without the whole logits."""
    if getattr(getattr(forward, "forward_fn", forward), "chunks_loss", False):  # (Note [chunked loss])
        return forward(input_ids=x, shift_labels=y, num_items_in_batch=num_items, **without_cache(x)).loss  # y: shifted
    return token_loss(forward(input_ids=x, **without_cache(x)).logits, y, num_items)


def _gpt_loss(forward, x: torch.Tensor, y: torch.Tensor, num_items: int | None = None) -> torch.Tensor:
    """The built-in GPT's loss (its forward's own cross-entropy of its logits), or the sum over `num_items`."""
    return token_loss(forward(x), y, num_items)


def build_model(cfg: ModelConfig, lora: LoraConfig | None = None, *, meta: bool = True,
                layers: int | None = None, sizes: dict | None = None) -> ModelBundle:
    """The model of `cfg` (and `lora`), created under infinity.meta_init() (no parameter memory) unless
    `meta=False`; `layers`: that many blocks instead of the config's (the estimator's shallow copies,
    Note [deepened estimate]); `sizes` (`gpt_sizes`'s symbols): the built-in GPT at those sizes, its small twin
    (Note [small twin])."""
    import contextlib
    import dataclasses

    from infinity.runtime.materialize import meta_init
    scope = meta_init() if meta else contextlib.nullcontext()
    if cfg.pretrained:
        return _pretrained(cfg, lora or LoraConfig(), scope, layers)
    if layers is not None:
        cfg = dataclasses.replace(cfg, n_layer=layers)
    if cfg.kind == "gpt":
        from infinity.models.gpt import GPT, GPTConfig, gpt_init
        gcfg = GPTConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, n_layer=cfg.n_layer, n_head=cfg.n_head,
                         d_model=cfg.d_model)
        if sizes is not None:
            gcfg = dataclasses.replace(gcfg, vocab_size=sizes["vocab"], seq_len=sizes["positions"],
                                       n_head=sizes["heads"], d_model=sizes["heads"] * sizes["head_dim"])
        if cfg.ffn_dim not in (0, 4 * cfg.d_model):
            raise ConfigError(f"model.ffn_dim = {cfg.ffn_dim}: the built-in gpt uses 4 * d_model = "
                              f"{4 * cfg.d_model}; remove it or use model.kind = \"gpt2\" / \"llama\"")
        with scope:
            model = GPT(gcfg)
        return ModelBundle(model, gpt_init, _gpt_loss, f"gpt {_count(model)}")
    transformers = need_transformers(f'model.kind = "{cfg.kind}"', 'or use model.kind = "gpt"')
    if cfg.kind == "gpt2":
        hf_cfg = transformers.GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.seq_len, n_embd=cfg.d_model,
                                         n_layer=cfg.n_layer, n_head=cfg.n_head, n_inner=cfg.ffn_dim or None,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                                         eos_token_id=None)
        cls = transformers.GPT2LMHeadModel
    else:
        hf_cfg = transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                                          intermediate_size=llama_ffn(cfg),
                                          num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                                          num_key_value_heads=cfg.n_kv_head or cfg.n_head,
                                          max_position_embeddings=cfg.seq_len, bos_token_id=None, eos_token_id=None,
                                          pad_token_id=None)
        cls = transformers.LlamaForCausalLM
    with scope:
        model = cls(hf_cfg)
    return ModelBundle(model, model._init_weights, _lm_loss, f"{cfg.kind} (transformers) {_count(model)}")


def llama_ffn(cfg: ModelConfig) -> int:
    """The MLP width of a `model.kind = "llama"` shape: model.ffn_dim, else Llama's 8/3 d rounded up to 64."""
    return cfg.ffn_dim or 64 * -(-(8 * cfg.d_model // 3) // 64)


def estimator_llama(cfg: ModelConfig, layers: int | None = None, sizes: dict | None = None) -> ModelBundle:
    """The `[model]` Llama shape as the estimator's torch-only copy (Note [estimator's Llama]), on the meta device;
    with `sizes` (estimate_llama.copy_sizes) at those sizes, its small twin (Note [small twin])."""
    from infinity.models.llama import LlamaForCausalLM, copy_dims
    from infinity.runtime.materialize import meta_init
    dims = copy_dims(sizes) if sizes else {"vocab": cfg.vocab_size, "d": cfg.d_model, "heads": cfg.n_head,
                                           "kv_heads": cfg.n_kv_head or cfg.n_head, "ffn": llama_ffn(cfg)}
    with meta_init():
        model = LlamaForCausalLM(dims["vocab"], dims["d"], layers or cfg.n_layer, dims["heads"], dims["kv_heads"],
                                 dims["ffn"])
    return ModelBundle(model, None, _lm_loss, f"llama (estimator's copy) {_count(model)}")


def gpt_sizes(cfg: ModelConfig) -> dict | None:
    """The built-in GPT's sizes as its small twin's symbols (Note [small twin]), in the order the twin takes its
    primes: heads and a head's width (d = their product), the tokens (batch, sequence: filled in per trace), the
    positions it embeds (after the sequence: the twin's then exceed its sequence, as the model's must), the
    vocabulary. Its qkv layer is 3 d wide: 3 is a constant of this model, not a size. None: not the built-in GPT."""
    if cfg.kind != "gpt" or cfg.pretrained or cfg.d_model % cfg.n_head:
        return None
    return {"heads": cfg.n_head, "head_dim": cfg.d_model // cfg.n_head, "batch": None, "seq": None,
            "positions": cfg.seq_len, "vocab": cfg.vocab_size}


def llama_sizes(cfg: ModelConfig) -> dict | None:
    """A `[model]` Llama shape's sizes as its small twin's symbols (Note [small twin]); None: it has no twin."""
    from infinity.models.llama import copy_sizes
    return copy_sizes(cfg.vocab_size, cfg.d_model, cfg.n_head, cfg.n_kv_head or cfg.n_head, llama_ffn(cfg))


def _count(model: nn.Module) -> str:
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return f"{n / 1e6:.2f}M parameters"


def need_transformers(what: str, alternative: str):
    """transformers, or a ConfigError naming `what` needs it and the install (or `alternative`)."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"{what} needs Hugging Face transformers: pip install transformers ({alternative})") from None
    return transformers


def check_pretrained_dir(cfg: ModelConfig) -> None:
    """model.pretrained names a directory (the first check of it, before its files are looked for)."""
    where = f"model.pretrained = {cfg.pretrained!r}"
    if os.path.isfile(cfg.pretrained):
        raise ConfigError(f"{where} is a file, not a directory: give the directory save_pretrained wrote (here "
                          f"probably {os.path.dirname(cfg.pretrained)!r})")
    if not os.path.isdir(cfg.pretrained):
        raise ConfigError(f"{where}: no such directory; give the directory save_pretrained wrote (config.json, the "
                          f"weights and the tokenizer)")


def _pretrained(cfg: ModelConfig, lora: LoraConfig, scope, layers: int | None = None) -> ModelBundle:
    """The Hugging Face model of model.pretrained on the meta device, LoRA-wrapped with [model.lora] r > 0, its
    weights to be read from the directory (Note [fine-tuning job])."""
    where = f"model.pretrained = {cfg.pretrained!r}"
    check_pretrained_dir(cfg)
    transformers = need_transformers(where, "or leave model.pretrained unset")
    if not os.path.isfile(os.path.join(cfg.pretrained, "config.json")):
        raise ConfigError(f"{where}: no config.json in it; give a directory written by save_pretrained (config.json "
                          f"and model.safetensors, or its index and shards)")
    try:
        hf_cfg = transformers.AutoConfig.from_pretrained(cfg.pretrained, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{where}: transformers cannot read its config.json ({e}); fix the file or upgrade "
                          f"transformers") from None
    _check_pretrained(cfg, getattr(hf_cfg, "vocab_size", None),
                      getattr(hf_cfg, "max_position_embeddings", None) or getattr(hf_cfg, "n_positions", None))
    if layers is not None:
        hf_cfg.num_hidden_layers = layers
    try:
        with scope:
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    except ValueError as e:
        raise ConfigError(f"{where}: not a causal language model transformers can build ({e})") from None
    total = _count(model)
    data = "bytes as token ids" if cfg.tokenizer == "bytes" else "its tokenizer"
    description = f"{hf_cfg.model_type} from {cfg.pretrained}, data: {data} ({total}"
    if lora.r:
        model = _with_lora(model, lora, cfg.pretrained)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        description += f"; LoRA r={lora.r}: {trainable / 1e6:.3f}M trainable"
    return ModelBundle(model, None, _lm_loss, description + ")", weights=cfg.pretrained, hf_config=hf_cfg)


def _check_pretrained(cfg: ModelConfig, vocab, positions) -> None:
    """A pretrained model's vocabulary against bytes as token ids, its positions against model.seq_len."""
    if cfg.tokenizer == "bytes" and (not isinstance(vocab, int) or vocab < VOCAB_SIZE):
        raise ConfigError(f"model.pretrained = {cfg.pretrained!r}: its vocabulary has {vocab} token ids, fewer than "
                          f"the {VOCAB_SIZE} byte values the job's data uses as token ids (model.tokenizer = "
                          f"\"bytes\"); fine-tune a model with at least {VOCAB_SIZE} ids, or save the model's "
                          f"tokenizer in it (tokenizer.save_pretrained) and set model.tokenizer = \"auto\" so the job "
                          f"tokenizes with it")
    if isinstance(positions, int) and cfg.seq_len > positions:
        raise ConfigError(f"model.seq_len = {cfg.seq_len}: {cfg.pretrained} was built for {positions} positions; "
                          f"set model.seq_len <= {positions}")


def estimator_pretrained_llama(cfg: ModelConfig, lora: LoraConfig, hf: dict, fields: dict, targets: tuple,
                               layers: int | None = None, sizes: dict | None = None) -> ModelBundle:
    """A pretrained Llama directory (its config.json `hf`, the copy's `fields` from estimate_llama.llama_fields)
    as the estimator's copy, LoRA-wrapped as PEFT wraps it with [model.lora] r > 0 (`targets`: its linears), on the
    meta device, without importing transformers or PEFT (Note [estimator's Llama]); the job's checks as
    `_pretrained` makes them (transformers and PEFT installed, the vocabulary, the positions). With `sizes`
    (estimate_llama.copy_sizes) at those sizes, its small twin (Note [small twin])."""
    from importlib.util import find_spec

    from infinity.models import llama as copy
    from infinity.runtime.materialize import meta_init
    where = f"model.pretrained = {cfg.pretrained!r}"
    if find_spec("transformers") is None:
        need_transformers(where, "or leave model.pretrained unset")
    _check_pretrained(cfg, hf.get("vocab_size"), hf.get("max_position_embeddings"))
    if lora.r and find_spec("peft") is None:
        raise ConfigError(f"model.lora.r = {lora.r} needs PEFT: pip install peft (or remove model.lora.r)")
    args = {k: v for k, v in fields.items() if k != "dtype"}
    r = lora.r
    if sizes is not None:
        dims = copy.copy_dims(sizes)
        r = dims.pop("r")
        args.update(dims)
    default = torch.get_default_dtype()
    torch.set_default_dtype(fields["dtype"])  # as transformers builds a config's dtype
    try:
        with meta_init():
            model = copy.LlamaForCausalLM(**{**args, "layers": layers or args["layers"]})
    finally:
        torch.set_default_dtype(default)
    description = f"llama from {cfg.pretrained} (estimator's copy) ({_count(model)}"
    if r:
        with meta_init():
            model = copy.PeftModelForCausalLM(model, r, lora.alpha, lora.dropout, targets)
        description += f"; LoRA r={r}"
    return ModelBundle(model, None, _lm_loss, description + ")", weights=cfg.pretrained)


def _with_lora(model: nn.Module, lora: LoraConfig, base: str) -> nn.Module:
    try:
        import peft
    except ImportError:
        raise ConfigError(f"model.lora.r = {lora.r} needs PEFT: pip install peft (or remove model.lora.r)") from None
    targets = list(lora.targets)
    shorthand = len(targets) == 1 and targets[0] == "all-linear"  # PEFT's shorthand: a string, PEFT resolves it
    config = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=targets[0] if shorthand else (targets or None), task_type="CAUSAL_LM")
    import warnings
    try:
        with warnings.catch_warnings():  # PEFT 0.21 reads the deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            wrapped = peft.get_peft_model(model, config)
        wrapped.peft_config["default"].base_model_name_or_path = base  # the export's base (Note [adapter directory])
        return wrapped
    except ValueError as e:  # e.g. a target that names no module, or no default for this kind of model
        own = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                      if type(m).__name__ in ("Linear", "Conv1D") and not n.endswith("lm_head")})
        raise ConfigError(f"model.lora.targets = {show(targets)}: PEFT cannot apply it ({e}); name the model's "
                          f"own linear layers (this model's: {', '.join(own[:10])}), e.g. targets = "
                          f"{show(own[:2])}, or [\"all-linear\"]") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # any one: DIR holds a tokenizer
# every file that decides the tokens a tokenizer gives (resume.py and the tokenized data cache hash them)
TOKENIZER_IDENTITY_FILES = (*TOKENIZER_FILES, "tokenizer_config.json", "merges.txt", "special_tokens_map.json",
                            "added_tokens.json", "chat_template.jinja")


def tokenizer_dir(cfg: ModelConfig) -> str | None:
    """The directory whose tokenizer tokenizes the job's data, or None for bytes (Note [fine-tuning job]); a
    pretrained directory without a tokenizer is refused unless model.tokenizer = "bytes" says bytes."""
    if not cfg.pretrained:
        return None
    check_pretrained_dir(cfg)
    if cfg.tokenizer == "bytes":
        return None
    if not any(os.path.isfile(os.path.join(cfg.pretrained, name)) for name in TOKENIZER_FILES):
        raise ConfigError(f"model.pretrained = {cfg.pretrained!r}: no tokenizer in it (none of "
                          f"{', '.join(TOKENIZER_FILES)}), and the model knows only its own token ids: save its "
                          f"tokenizer there (AutoTokenizer.from_pretrained(<its source>).save_pretrained(DIR)), or set "
                          f'model.tokenizer = "bytes" to train on bytes as token ids (0..255) on purpose')
    return cfg.pretrained


def runtime_modules(cfg: ModelConfig, lora: LoraConfig) -> tuple[str, ...]:
    """The Python modules a run of this model imports beyond torch and infinity, for the estimate's runtime
    probe (Note [peak memory] runtime: transformers' modeling code alone is ~160 MiB of a tiny Llama run's RSS):
    the transformers model of `model.kind` or of the pretrained directory's config.json `model_type`, its
    tokenizer classes when the data is tokenized by it, and PEFT with LoRA."""
    import json
    kind = cfg.kind
    if cfg.pretrained:
        try:
            with open(os.path.join(cfg.pretrained, "config.json")) as f:
                kind = str(json.load(f).get("model_type") or "")
        except (OSError, ValueError):
            kind = ""
    out = []
    if (kind and kind != "gpt") or cfg.pretrained:
        out.append(f"transformers.models.{kind}.modeling_{kind}" if kind else "transformers")
    if cfg.pretrained and cfg.tokenizer != "bytes":
        out.append("transformers.models.auto.tokenization_auto")
    if lora.r:
        out.append("peft")
    return tuple(out)
