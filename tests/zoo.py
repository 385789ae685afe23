"""The model zoo: small, real model cases for ckptc's tests, demo and benchmarks.

It lives with the tests (they must not depend on the benchmark); ``bench/``
imports it from here (``from tests.zoo import get_case``).

Every factory ``make_<name>(size="tiny", seq_len=None, batch=None, seed=0)``
returns a :class:`ModelCase`: a freshly built model in train mode with random
weights (nothing is downloaded), example inputs, and a loss function reducing
the model output to a scalar. One training step is::

    case = get_case("gpt2")
    loss = case.loss(case.model(*case.example_inputs, **case.example_kwargs))
    loss.backward()

or ``case.forward_loss().backward()``; pass ``case.forward_loss(compiled)`` to
run the same step through a wrapped/compiled version of ``case.model``.

Conventions:

* ``size="tiny"`` exists for every model and runs forward+backward in well under
  a second on a 2-core CPU; larger sizes ("bench", or "long" for mamba) are for
  benchmarks. ``seq_len``/``batch`` left as ``None`` take the size's defaults.
* Construction is deterministic: weights and inputs depend only on the
  arguments (``seed`` in particular), and the global RNG state is restored
  afterwards. Forward passes of models with dropout still consume the global
  RNG; seed it yourself if you compare two runs.
* ``example_kwargs`` only ever holds tensors, so every model input is a tensor.
  Hugging Face models get ``labels=`` and compute their own loss, so their
  ``loss`` just reads ``output.loss``. Models without a built-in loss have their
  target tensor bound into ``loss``.
* Hugging Face configs set ``use_cache=False``: in training the KV cache is
  useless, and returning it would keep per-layer K/V activations alive as
  outputs, which distorts any memory measurement.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.caduceus import MASK_ID, NUCLEOTIDES, TOKEN_ID, BiMambaDNA, masked_lm_loss
from tests.hyena import HyenaConfig, HyenaDNA, next_token_loss

LossFn = Callable[[Any], Tensor]
ModelFactory = Callable[..., "ModelCase"]


def model_output_loss(output: Any) -> Tensor:
    """Return the loss a Hugging Face model computed from ``labels=``.

    Handles ``ModelOutput`` (attribute or key ``loss``) and the tuple form
    (``return_dict=False``), where the loss comes first.
    """
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)):
        loss = output[0]
    if not isinstance(loss, Tensor):
        raise TypeError(f"model output of type {type(output).__name__} carries no loss tensor; was `labels=` passed?")
    return loss


@dataclass
class ModelCase:
    """A model plus everything needed to run one training step on it."""

    name: str
    model: nn.Module
    example_inputs: tuple[Tensor, ...]
    example_kwargs: dict[str, Tensor] = field(default_factory=dict)
    loss: LossFn = model_output_loss

    def forward_loss(self, model: Callable[..., Any] | None = None) -> Tensor:
        """Run ``model`` (default: ``self.model``) on the example inputs and reduce to the scalar loss."""
        run = self.model if model is None else model
        return self.loss(run(*self.example_inputs, **self.example_kwargs))

    def num_parameters(self) -> int:
        """Number of distinct parameters (tied weights counted once)."""
        return sum(p.numel() for p in self.model.parameters())


@dataclass(frozen=True)
class _Size:
    """One named size of a model: config overrides plus default sequence length and batch."""

    config: dict[str, Any]
    seq_len: int | None  # None for models without a sequence dimension
    batch: int


def _pick_size(name: str, sizes: Mapping[str, _Size], size: str) -> _Size:
    if size not in sizes:
        raise ValueError(f"{name}: unknown size {size!r}; available: {sorted(sizes)}")
    return sizes[size]


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed the global RNG for the block and restore it afterwards.

    Module constructors draw their initial weights from the global RNG, so it
    has to be seeded (not just a private Generator), but callers should not see
    their RNG stream change because they built a model.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _resolve(value: int | None, default: int) -> int:
    """``value`` if given, else the size's default; rejects non-positive values early."""
    value = default if value is None else value
    if value <= 0:
        raise ValueError(f"sequence length and batch must be positive, got {value}")
    return value


def _no_sequence(name: str, seq_len: int | None) -> None:
    if seq_len is not None:
        raise ValueError(f"{name} has no sequence dimension; seq_len must be None")


def _random_tokens(vocab_size: int, batch: int, seq_len: int) -> Tensor:
    return torch.randint(0, vocab_size, (batch, seq_len))


# --------------------------------------------------------------------------- #
# Hugging Face transformers                                                    #
# --------------------------------------------------------------------------- #

_GPT2_SIZES = {
    "tiny": _Size(dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128), seq_len=32, batch=2),
    "bench": _Size(dict(n_layer=6, n_embd=384, n_head=6, vocab_size=4096, n_positions=1024), seq_len=512, batch=4),
}


def make_gpt2(
    size: str = "tiny",
    seq_len: int | None = None,
    batch: int | None = None,
    seed: int = 0,
    *,
    attn_implementation: str = "eager",
) -> ModelCase:
    """GPT-2 causal LM (``GPT2LMHeadModel``) with dropout on, tied input/output embeddings.

    Dropout 0.1 on embeddings, residuals and attention probabilities (GPT-2's
    defaults), so this is the case for testing RNG replay under recomputation.
    ``attn_implementation`` is "eager" (explicit softmax(QK^T)V, the attention
    matrix is a visible activation) or "sdpa" (fused scaled_dot_product_attention).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    spec = _pick_size("gpt2", _GPT2_SIZES, size)
    seq_len, batch = _resolve(seq_len, spec.seq_len), _resolve(batch, spec.batch)
    config = GPT2Config(
        **{**spec.config, "n_positions": max(spec.config["n_positions"], seq_len)},
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    with _seeded(seed):
        model = GPT2LMHeadModel(config).train()
        # transformers cannot infer the loss type from the class name "GPT2LMHeadModel", so every
        # forward logs a warning_once and falls back to ForCausalLM; that logging call is also a
        # torch.compile graph break. Naming the same loss explicitly removes both.
        model.loss_type = "ForCausalLM"
        input_ids = _random_tokens(config.vocab_size, batch, seq_len)
    # labels are a separate tensor (not input_ids itself) so inputs never alias each other.
    return ModelCase("gpt2", model, (input_ids,), {"labels": input_ids.clone()})


def gpt2_without_dropout(
    layers: int, width: int, vocab: int, *, heads: int | None = None, positions: int = 1024, seed: int = 0
) -> torch.nn.Module:
    """A bare ``GPT2LMHeadModel`` with dropout off (one head per 64 channels unless ``heads``), for comparisons
    with compilers whose fused kernels draw other random numbers than eager PyTorch (Inductor)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=heads or max(1, width // 64),
        n_positions=positions,
        vocab_size=vocab,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    with _seeded(seed):
        model = GPT2LMHeadModel(config).train()
    model.loss_type = "ForCausalLM"  # as in make_gpt2: no warning_once (a graph break) per forward
    return model


_LLAMA_SIZES = {
    "tiny": _Size(
        dict(
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            max_position_embeddings=128,
        ),
        seq_len=32,
        batch=2,
    ),
    "bench": _Size(
        dict(
            hidden_size=384,
            intermediate_size=1024,
            num_hidden_layers=6,
            num_attention_heads=6,
            num_key_value_heads=2,
            vocab_size=4096,
            max_position_embeddings=1024,
        ),
        seq_len=512,
        batch=4,
    ),
}


def make_llama(
    size: str = "tiny",
    seq_len: int | None = None,
    batch: int | None = None,
    seed: int = 0,
    *,
    attn_implementation: str = "eager",
) -> ModelCase:
    """Llama causal LM (``LlamaForCausalLM``): RMSNorm, rotary embeddings, SwiGLU, grouped-query attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = _pick_size("llama", _LLAMA_SIZES, size)
    seq_len, batch = _resolve(seq_len, spec.seq_len), _resolve(batch, spec.batch)
    config = LlamaConfig(
        **{**spec.config, "max_position_embeddings": max(spec.config["max_position_embeddings"], seq_len)},
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    with _seeded(seed):
        model = LlamaForCausalLM(config).train()
        input_ids = _random_tokens(config.vocab_size, batch, seq_len)
    return ModelCase("llama", model, (input_ids,), {"labels": input_ids.clone()})


_MIXTRAL_SIZES = {
    "tiny": _Size(
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            max_position_embeddings=128,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        seq_len=32,
        batch=2,
    ),
}


def make_mixtral(
    size: str = "tiny",
    seq_len: int | None = None,
    batch: int | None = None,
    seed: int = 0,
    *,
    attn_implementation: str = "eager",
) -> ModelCase:
    """Mixtral sparse mixture of experts (``MixtralForCausalLM``): top-2 routing over 4 experts per layer.

    Its MoE block loops over the experts that received tokens (a data-dependent loop), which
    ``torch.compile`` cannot keep in one graph.
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    spec = _pick_size("mixtral", _MIXTRAL_SIZES, size)
    seq_len, batch = _resolve(seq_len, spec.seq_len), _resolve(batch, spec.batch)
    config = MixtralConfig(**spec.config, use_cache=False, attn_implementation=attn_implementation)
    with _seeded(seed):
        model = MixtralForCausalLM(config).train()
        input_ids = _random_tokens(config.vocab_size, batch, seq_len)
    return ModelCase("mixtral", model, (input_ids,), {"labels": input_ids.clone()})


_OLMOE_SIZES = {
    "tiny": _Size(
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=128,
            max_position_embeddings=128,
            num_experts=4,
            num_experts_per_tok=2,
        ),
        seq_len=16,
        batch=2,
    ),
}


def make_olmoe(
    size: str = "tiny",
    seq_len: int | None = None,
    batch: int | None = None,
    seed: int = 0,
    *,
    attn_implementation: str = "eager",
) -> ModelCase:
    """OLMoE sparse mixture of experts (``OlmoeForCausalLM``): top-2 of 4 experts, a static loop over experts
    whose token selection (``torch.where``) has a data-dependent size."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    spec = _pick_size("olmoe", _OLMOE_SIZES, size)
    seq_len, batch = _resolve(seq_len, spec.seq_len), _resolve(batch, spec.batch)
    config = OlmoeConfig(**spec.config, use_cache=False, attn_implementation=attn_implementation)
    with _seeded(seed):
        model = OlmoeForCausalLM(config).train()
        input_ids = _random_tokens(config.vocab_size, batch, seq_len)
    return ModelCase("olmoe", model, (input_ids,), {"labels": input_ids.clone()})


_OPT_SIZES = {
    "tiny": _Size(
        dict(
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=256,
            max_position_embeddings=128,
            word_embed_proj_dim=64,
        ),
        seq_len=32,
        batch=2,
    ),
}


def make_opt(
    size: str = "tiny",
    seq_len: int | None = None,
    batch: int | None = None,
    seed: int = 0,
    *,
    attn_implementation: str = "eager",
) -> ModelCase:
    """OPT causal LM (``OPTForCausalLM``): learned positions from the attention mask's cumulative sum, dropout."""
    from transformers import OPTConfig, OPTForCausalLM

    spec = _pick_size("opt", _OPT_SIZES, size)
    seq_len, batch = _resolve(seq_len, spec.seq_len), _resolve(batch, spec.batch)
    config = OPTConfig(**spec.config, use_cache=False, attn_implementation=attn_implementation)
    with _seeded(seed):
        model = OPTForCausalLM(config).train()
        input_ids = _random_tokens(config.vocab_size, batch, seq_len)
    return ModelCase("opt", model, (input_ids,), {"labels": input_ids.clone()})


_BERT_SIZES = {
    "tiny": _Size(
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=256,
            max_position_embeddings=128,
        ),
        seq_len=32,
        batch=2,
    ),
    "bench": _Size(
        dict(
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=1024,
            vocab_size=4096,
            max_position_embeddings=512,
        ),
        seq_len=512,
        batch=4,
    ),
}


def make_bert(
    size: str = "tiny",
    seq_len: int | None = None,
    batch: int | None = None,
    seed: int = 0,
    *,
    attn_implementation: str = "eager",
    mask_prob: float = 0.15,
) -> ModelCase:
    """BERT masked LM (``BertForMaskedLM``); the MLM decoder is tied to the word embeddings.

    About ``mask_prob`` of the tokens are replaced by a mask id and are the only
    positions with a label (others are -100); position 1 of every row is always
    masked so the loss is never an empty mean.
    """
    from transformers import BertConfig, BertForMaskedLM

    spec = _pick_size("bert", _BERT_SIZES, size)
    seq_len, batch = _resolve(seq_len, spec.seq_len), _resolve(batch, spec.batch)
    config = BertConfig(
        **{**spec.config, "max_position_embeddings": max(spec.config["max_position_embeddings"], seq_len)},
        tie_word_embeddings=True,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    mask_token_id = config.vocab_size - 1
    with _seeded(seed):
        model = BertForMaskedLM(config).train()
        tokens = torch.randint(0, mask_token_id, (batch, seq_len))
        masked = torch.rand(batch, seq_len) < mask_prob
    masked[:, min(1, seq_len - 1)] = True
    labels = tokens.masked_fill(~masked, -100)
    input_ids = tokens.masked_fill(masked, mask_token_id)
    return ModelCase("bert", model, (input_ids,), {"labels": labels})


_MAMBA_SIZES = {
    "tiny": _Size(
        dict(hidden_size=64, state_size=8, num_hidden_layers=2, vocab_size=256, expand=2, conv_kernel=4),
        seq_len=16,
        batch=2,
    ),
    # Small width on purpose: the stock CPU path's backward costs O(layers * L^2 * d_inner * state)
    # (see make_mamba); at this width one eager step at L=1024 takes a few seconds.
    "long": _Size(
        dict(hidden_size=64, state_size=8, num_hidden_layers=4, vocab_size=256, expand=2, conv_kernel=4),
        seq_len=1024,
        batch=1,
    ),
}


def make_mamba(
    size: str = "tiny",
    seq_len: int | None = None,
    batch: int | None = None,
    seed: int = 0,
    *,
    use_mambapy: bool = False,
) -> ModelCase:
    """Mamba causal LM (``MambaForCausalLM``), a selective state-space model.

    Without the CUDA kernels, transformers runs the selective scan as a Python
    loop over time steps (``MambaMixer.slow_forward``): a traced graph has
    ~7 ops per step per layer (~30k ops for "long"), and each step indexes one
    time slice of (batch, d_inner, L, state) tensors, whose backward
    materialises a full-size gradient per step, so backward time grows with L^2.
    ``use_mambapy=True`` switches to the log-depth parallel scan of the
    ``mambapy`` package (not installed here; transformers raises ImportError).

    Known issue (torch 2.13): under ``torch.compile(backend="aot_eager")`` the
    backward fails with "view size is not compatible with input tensor's size
    and stride": the fake-tensor kernel of ``aten.softplus_backward`` (used for
    ``dt``) lays its result out like its input, while the eager kernel follows
    the transposed incoming gradient. Backends that decompose it
    ("aot_eager_decomp_partition", inductor) are unaffected, and so is ckptc,
    which decomposes it (``ckptc._torch_internals.workaround_decompositions``;
    ``tests/test_models_ssm.py``).
    """
    from transformers import MambaConfig, MambaForCausalLM

    spec = _pick_size("mamba", _MAMBA_SIZES, size)
    seq_len, batch = _resolve(seq_len, spec.seq_len), _resolve(batch, spec.batch)
    config = MambaConfig(**spec.config, use_cache=False, use_mambapy=use_mambapy)
    with _seeded(seed):
        model = MambaForCausalLM(config).train()
        input_ids = _random_tokens(config.vocab_size, batch, seq_len)
    return ModelCase("mamba", model, (input_ids,), {"labels": input_ids.clone()})


_VIT_SIZES = {
    # seq_len is the number of patch tokens (without [CLS]); image side = sqrt(seq_len) * patch_size.
    "tiny": _Size(
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            patch_size=8,
            num_labels=10,
        ),
        seq_len=16,
        batch=2,
    ),
    # ViT-Ti/16 at 224x224 (Touvron et al. 2021), ImageNet-1k head.
    "bench": _Size(
        dict(
            hidden_size=192,
            num_hidden_layers=12,
            num_attention_heads=3,
            intermediate_size=768,
            patch_size=16,
            num_labels=1000,
        ),
        seq_len=196,
        batch=8,
    ),
}


def make_vit(
    size: str = "tiny",
    seq_len: int | None = None,
    batch: int | None = None,
    seed: int = 0,
    *,
    attn_implementation: str = "eager",
) -> ModelCase:
    """Vision Transformer classifier (``ViTForImageClassification``) on random images.

    ``seq_len`` is the number of patches and must be a perfect square.
    """
    from transformers import ViTConfig, ViTForImageClassification

    spec = _pick_size("vit", _VIT_SIZES, size)
    seq_len, batch = _resolve(seq_len, spec.seq_len), _resolve(batch, spec.batch)
    patches_per_side = math.isqrt(seq_len)
    if patches_per_side**2 != seq_len:
        raise ValueError(f"vit: seq_len (number of patches) must be a perfect square, got {seq_len}")
    config = ViTConfig(
        **spec.config, image_size=patches_per_side * spec.config["patch_size"], attn_implementation=attn_implementation
    )
    with _seeded(seed):
        model = ViTForImageClassification(config).train()
        pixel_values = torch.randn(batch, config.num_channels, config.image_size, config.image_size)
        labels = torch.randint(0, config.num_labels, (batch,))
    return ModelCase("vit", model, (pixel_values,), {"labels": labels})


# --------------------------------------------------------------------------- #
# Genomics: Enformer (enformer-pytorch), our HyenaDNA- and Caduceus-style models #
# --------------------------------------------------------------------------- #

_ENFORMER_SIZES = {
    # seq_len is in base pairs. The trunk downsamples by 2**num_downsamples into bins and the
    # output keeps the central `target_length` bins (crop), like the original 196_608 bp -> 896.
    # dim // heads must be divisible by 6 (relative position basis functions).
    "tiny": _Size(
        dict(
            dim=48, depth=1, heads=2, attn_dim_key=8, num_downsamples=7, dim_divisible_by=8, output_heads=dict(human=16)
        ),
        seq_len=2048,
        batch=2,
    ),
    "bench": _Size(
        dict(
            dim=192,
            depth=4,
            heads=4,
            attn_dim_key=32,
            num_downsamples=7,
            dim_divisible_by=32,
            output_heads=dict(human=256),
        ),
        seq_len=65536,
        batch=1,
    ),
}


def enformer_target_length(seq_len: int, num_downsamples: int) -> int:
    """Number of output bins kept for a ``seq_len`` bp input: the central 7/12, as 896 of 1536 in Enformer.

    The crop removes the same number of bins from each side, so the kept count
    must have the parity of the bin count.
    """
    bins = seq_len // 2**num_downsamples
    target = max(1, bins * 7 // 12)
    return target if (bins - target) % 2 == 0 else target + 1


def make_enformer(size: str = "tiny", seq_len: int | None = None, batch: int | None = None, seed: int = 0) -> ModelCase:
    """Enformer (``enformer_pytorch.Enformer``): conv tower + attention-pool downsampling + transformer.

    Input is one-hot DNA (batch, seq_len, 4), float, which the model takes as is
    (index input would add a ``one_hot`` inside the model). Loss is Enformer's
    Poisson loss of the 'human' head against random non-negative track values.
    ``seq_len`` must be a multiple of ``2**num_downsamples`` (128).
    """
    from enformer_pytorch import Enformer
    from enformer_pytorch.modeling_enformer import poisson_loss

    spec = _pick_size("enformer", _ENFORMER_SIZES, size)
    seq_len, batch = _resolve(seq_len, spec.seq_len), _resolve(batch, spec.batch)
    bin_size = 2 ** spec.config["num_downsamples"]
    if seq_len % bin_size != 0:
        raise ValueError(f"enformer: seq_len must be a multiple of {bin_size}, got {seq_len}")
    target_length = enformer_target_length(seq_len, spec.config["num_downsamples"])
    if batch * target_length < 2:
        # The final pointwise ConvBlock starts with BatchNorm1d, which needs >1 value per channel in training.
        raise ValueError(f"enformer: batch * output bins must be >= 2 (BatchNorm), got {batch} x {target_length}")
    with _seeded(seed):
        model = Enformer.from_hparams(**spec.config, target_length=target_length).train()
        one_hot_dna = F.one_hot(torch.randint(0, 4, (batch, seq_len)), num_classes=4).float()
        target = torch.rand(batch, target_length, spec.config["output_heads"]["human"])
    return ModelCase(
        "enformer",
        model,
        (one_hot_dna,),
        {},
        loss=functools.partial(_enformer_poisson_loss, poisson_loss=poisson_loss, target=target),
    )


def _enformer_poisson_loss(
    output: Mapping[str, Tensor], *, poisson_loss: Callable[[Tensor, Tensor], Tensor], target: Tensor
) -> Tensor:
    return poisson_loss(output["human"], target)


_HYENA_SIZES = {
    "tiny": _Size(dict(d_model=32, n_layer=2, filter_width=32), seq_len=256, batch=2),
    # HyenaDNA-tiny width (128) with 4 layers at a 16k context; d_model=256 (HyenaDNA-small)
    # roughly doubles the step time on a 2-core CPU.
    "bench": _Size(dict(d_model=128, n_layer=4, filter_width=64), seq_len=16384, batch=1),
}


def make_hyena(size: str = "tiny", seq_len: int | None = None, batch: int | None = None, seed: int = 0) -> ModelCase:
    """HyenaDNA-style long-convolution DNA language model (``tests.hyena``), next-nucleotide loss."""
    spec = _pick_size("hyena", _HYENA_SIZES, size)
    seq_len, batch = _resolve(seq_len, spec.seq_len), _resolve(batch, spec.batch)
    config = HyenaConfig(**spec.config, max_seq_len=seq_len)
    with _seeded(seed):
        model = HyenaDNA(config).train()
        # Ids 0-3 stand for A/C/G/T; the rest of the vocabulary is specials/padding.
        input_ids = torch.randint(0, 4, (batch, seq_len))
    return ModelCase("hyena", model, (input_ids,), {}, loss=functools.partial(_next_token_loss_on, input_ids=input_ids))


def _next_token_loss_on(logits: Tensor, *, input_ids: Tensor) -> Tensor:
    return next_token_loss(logits, input_ids)


_CADUCEUS_SIZES = {
    # The slow path traces a Python loop over time steps, twice (both strands): a short tiny sequence.
    "tiny": _Size(
        dict(hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4), seq_len=16, batch=2
    ),
    # The stock CPU path unrolls a Python loop over time steps into the graph, so long DNA sequences
    # take mamba.py's parallel scan (transformers' ``use_mambapy``): the graph grows with log L, not L.
    "bench": _Size(
        dict(hidden_size=64, state_size=8, num_hidden_layers=4, expand=2, conv_kernel=4, use_mambapy=True),
        seq_len=2048,
        batch=1,
    ),
}


def make_caduceus(
    size: str = "tiny", seq_len: int | None = None, batch: int | None = None, seed: int = 0, *, mask_prob: float = 0.15
) -> ModelCase:
    """Caduceus-style bidirectional Mamba DNA model (``tests.caduceus.BiMambaDNA``), masked-LM loss.

    Input is random nucleotides (A, C, G, T, a few N) as token ids of the
    12-token Caduceus vocabulary; about ``mask_prob`` of them are replaced by
    ``[MASK]`` and are the only positions with a label (position 1 of every row
    is always masked, so the loss is never an empty mean).  Built on
    transformers' ``MambaModel`` without CUDA kernels (the slow path).
    """
    from transformers import MambaConfig

    spec = _pick_size("caduceus", _CADUCEUS_SIZES, size)
    seq_len, batch = _resolve(seq_len, spec.seq_len), _resolve(batch, spec.batch)
    config = MambaConfig(
        **{"use_mambapy": False, **spec.config},
        vocab_size=len(TOKEN_ID),
        pad_token_id=TOKEN_ID["[PAD]"],
        use_cache=False,
    )
    nucleotide_ids = torch.tensor([TOKEN_ID[n] for n in NUCLEOTIDES])
    with _seeded(seed):
        model = BiMambaDNA(config).train()
        # N (unknown base) is rare in real genomes: 1 in 50 here.
        bases = torch.multinomial(
            torch.tensor([0.245, 0.245, 0.245, 0.245, 0.02]), batch * seq_len, replacement=True
        ).view(batch, seq_len)
        tokens = nucleotide_ids[bases]
        masked = torch.rand(batch, seq_len) < mask_prob
    masked[:, min(1, seq_len - 1)] = True
    labels = tokens.masked_fill(~masked, -100)
    input_ids = tokens.masked_fill(masked, MASK_ID)
    return ModelCase("caduceus", model, (input_ids,), {}, loss=functools.partial(_masked_lm_loss_on, labels=labels))


def _masked_lm_loss_on(logits: Tensor, *, labels: Tensor) -> Tensor:
    return masked_lm_loss(logits, labels)


# --------------------------------------------------------------------------- #
# Plain in-repo models for quick tests                                         #
# --------------------------------------------------------------------------- #


class DeepMLP(nn.Module):
    """``depth`` x (Linear -> GELU), then a linear classifier: a long chain with no skip connections."""

    def __init__(self, in_features: int, width: int, depth: int, num_classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Linear(in_features if i == 0 else width, width), nn.GELU()]
        self.hidden = nn.Sequential(*layers)
        self.classifier = nn.Linear(width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.hidden(x))


_MLP_SIZES = {
    "tiny": _Size(dict(in_features=32, width=64, depth=8, num_classes=10), seq_len=None, batch=16),
    "bench": _Size(dict(in_features=512, width=2048, depth=8, num_classes=1000), seq_len=None, batch=512),
}


def make_mlp(size: str = "tiny", seq_len: int | None = None, batch: int | None = None, seed: int = 0) -> ModelCase:
    """8-layer MLP classifier on random features; cross-entropy against random labels."""
    _no_sequence("mlp", seq_len)
    spec = _pick_size("mlp", _MLP_SIZES, size)
    batch = _resolve(batch, spec.batch)
    with _seeded(seed):
        model = DeepMLP(**spec.config).train()
        features = torch.randn(batch, spec.config["in_features"])
        labels = torch.randint(0, spec.config["num_classes"], (batch,))
    return ModelCase("mlp", model, (features,), {}, loss=functools.partial(_cross_entropy_to, labels=labels))


class ResidualConvBlock(nn.Module):
    """ResNet basic block: (conv3x3 -> BN -> ReLU -> conv3x3 -> BN) + identity, then ReLU."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
        )

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x + self.body(x))


class SmallResNet(nn.Module):
    """Conv stem, residual BN blocks, global average pool, dropout, linear head."""

    def __init__(
        self, in_channels: int, channels: int, num_blocks: int, num_classes: int, dropout: float = 0.2
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()
        )
        self.blocks = nn.Sequential(*(ResidualConvBlock(channels) for _ in range(num_blocks)))
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        pooled = self.blocks(self.stem(x)).mean(dim=(2, 3))
        return self.head(self.dropout(pooled))


_CONVNET_SIZES = {
    "tiny": _Size(dict(in_channels=3, channels=16, num_blocks=2, num_classes=10, image_size=16), seq_len=None, batch=4),
    "bench": _Size(
        dict(in_channels=3, channels=64, num_blocks=4, num_classes=100, image_size=32), seq_len=None, batch=32
    ),
}


def make_convnet(size: str = "tiny", seq_len: int | None = None, batch: int | None = None, seed: int = 0) -> ModelCase:
    """Small ResNet-style CNN (BatchNorm, residuals, dropout) on random images; cross-entropy loss."""
    _no_sequence("convnet", seq_len)
    spec = _pick_size("convnet", _CONVNET_SIZES, size)
    batch = _resolve(batch, spec.batch)
    config = dict(spec.config)
    image_size = config.pop("image_size")
    with _seeded(seed):
        model = SmallResNet(**config).train()
        images = torch.randn(batch, config["in_channels"], image_size, image_size)
        labels = torch.randint(0, config["num_classes"], (batch,))
    return ModelCase("convnet", model, (images,), {}, loss=functools.partial(_cross_entropy_to, labels=labels))


def _cross_entropy_to(logits: Tensor, *, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits, labels)


# --------------------------------------------------------------------------- #
# Registry                                                                     #
# --------------------------------------------------------------------------- #

MODELS: dict[str, ModelFactory] = {
    "gpt2": make_gpt2,
    "llama": make_llama,
    "mixtral": make_mixtral,
    "olmoe": make_olmoe,
    "opt": make_opt,
    "bert": make_bert,
    "mamba": make_mamba,
    "vit": make_vit,
    "enformer": make_enformer,
    "hyena": make_hyena,
    "caduceus": make_caduceus,
    "mlp": make_mlp,
    "convnet": make_convnet,
}

MODEL_SIZES: dict[str, tuple[str, ...]] = {
    "gpt2": tuple(_GPT2_SIZES),
    "llama": tuple(_LLAMA_SIZES),
    "mixtral": tuple(_MIXTRAL_SIZES),
    "olmoe": tuple(_OLMOE_SIZES),
    "opt": tuple(_OPT_SIZES),
    "bert": tuple(_BERT_SIZES),
    "mamba": tuple(_MAMBA_SIZES),
    "vit": tuple(_VIT_SIZES),
    "enformer": tuple(_ENFORMER_SIZES),
    "hyena": tuple(_HYENA_SIZES),
    "caduceus": tuple(_CADUCEUS_SIZES),
    "mlp": tuple(_MLP_SIZES),
    "convnet": tuple(_CONVNET_SIZES),
}


def get_case(name: str, **kwargs: Any) -> ModelCase:
    """Build the case ``name`` from :data:`MODELS`; ``kwargs`` go to its factory (size, seq_len, batch, seed, ...)."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; available: {sorted(MODELS)}") from None
    return factory(**kwargs)
