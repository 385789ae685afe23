"""A small HyenaDNA-style long-convolution language model over nucleotides.

The model is a pre-norm residual stack of Hyena operators (an attention-free
sequence mixer) and MLPs, trained as a next-nucleotide language model:

    embedding -> N x [x + Hyena(LN(x)); x + MLP(LN(x))] -> LN -> tied LM head

The Hyena operator (order 2 by default) projects the input into ``order + 1``
streams, mixes each with a short causal depthwise convolution, then alternates
element-wise gating with a causal *long* convolution whose filter spans the whole
sequence. The long filter is not stored explicitly: a small MLP maps positional
features to filter values ("implicit filter") and an exponentially decaying
window modulates it. The long convolution is computed with FFTs over ``2L`` so
that the circular convolution equals the causal linear one, in O(L log L).

References:
    Poli et al. 2023, "Hyena Hierarchy: Towards Larger Convolutional Language
    Models", ICML 2023, arXiv:2302.10866.
    Nguyen et al. 2023, "HyenaDNA: Long-Range Genomic Sequence Modeling at
    Single Nucleotide Resolution", NeurIPS 2023, arXiv:2306.15794.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class HyenaConfig:
    """Hyperparameters of :class:`HyenaDNA` (defaults match HyenaDNA-tiny, except length)."""

    vocab_size: int = 16  # HyenaDNA's 12-character nucleotide vocabulary, padded to 16
    d_model: int = 128
    n_layer: int = 2
    max_seq_len: int = 1024  # positional features are precomputed up to this length
    order: int = 2  # number of gates; order - 1 long convolutions per operator
    filter_width: int = 64  # hidden width of the implicit filter MLP
    pos_emb_dim: int = 5  # 1 time feature + 2 frequency bands x (cos, sin)
    short_kernel: int = 3
    mlp_ratio: int = 4
    dropout: float = 0.0


def fft_causal_conv(u: Tensor, k: Tensor, skip: Tensor) -> Tensor:
    """Causal convolution of ``u`` (B, D, L) with per-channel filters ``k`` (D, L), plus ``skip * u``.

    Both are zero-padded to 2L before the FFT so the circular convolution computed
    in frequency space equals the causal linear convolution on the first L outputs.
    """
    seq_len = u.shape[-1]
    fft_len = 2 * seq_len
    k_freq = torch.fft.rfft(k, n=fft_len)
    u_freq = torch.fft.rfft(u, n=fft_len)
    y = torch.fft.irfft(u_freq * k_freq, n=fft_len)[..., :seq_len]
    return y + u * skip[:, None]


class Sin(nn.Module):
    """``sin(freq * x)`` with a learnable per-feature frequency; the implicit filter's activation."""

    def __init__(self, dim: int, freq: float = 1.0) -> None:
        super().__init__()
        self.freq = nn.Parameter(torch.full((dim,), freq))

    def forward(self, x: Tensor) -> Tensor:
        return torch.sin(self.freq * x)


class ImplicitLongFilter(nn.Module):
    """Produces ``num_filters`` causal filters of shape (D, L) from positional features.

    The features are normalised time ``t`` in [0, 1] plus cos/sin of a few
    frequencies; an MLP with sine activations maps them to filter taps and an
    exponential decay (a different rate per channel) biases channels towards
    short or long memory, as in Hyena's ``ExponentialModulation``.
    """

    def __init__(
        self,
        config: HyenaConfig,
        num_filters: int,
        fast_decay_pct: float = 0.3,
        slow_decay_pct: float = 1.5,
        target: float = 1e-2,
    ) -> None:
        super().__init__()
        self.num_filters, self.d_model = num_filters, config.d_model
        bands = (config.pos_emb_dim - 1) // 2
        length = config.max_seq_len
        t = torch.linspace(0, 1, length)[:, None]  # (L, 1)
        angle = 2 * math.pi * torch.arange(length)[:, None] / length * torch.linspace(1e-4, bands - 1, bands)
        # Buffers, not parameters: they are fixed features, but they must follow .to(device).
        self.register_buffer("time", t, persistent=False)
        self.register_buffer("features", torch.cat([t, angle.cos(), -angle.sin()], dim=-1), persistent=False)
        width = config.filter_width
        self.mlp = nn.Sequential(
            nn.Linear(config.pos_emb_dim, width),
            Sin(width),
            nn.Linear(width, width),
            Sin(width),
            nn.Linear(width, num_filters * config.d_model, bias=False),
        )
        # Decay rates chosen so the envelope reaches `target` after fast/slow_pct of the sequence.
        decay = torch.linspace(math.log(target) / slow_decay_pct, math.log(target) / fast_decay_pct, config.d_model)
        self.register_buffer("decay_rates", decay.abs(), persistent=False)
        self.skip = nn.Parameter(torch.randn(num_filters, config.d_model))  # the "D" term of the SSM view

    def forward(self, seq_len: int) -> Tensor:
        """Return filters of shape (num_filters, D, seq_len)."""
        if seq_len > self.features.shape[0]:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {self.features.shape[0]}")
        taps = self.mlp(self.features[:seq_len])  # (L, num_filters * D)
        taps = taps * torch.exp(-self.time[:seq_len] * self.decay_rates.repeat(self.num_filters))
        return taps.T.reshape(self.num_filters, self.d_model, seq_len)


class HyenaOperator(nn.Module):
    """Order-N Hyena mixer: projections, short conv, then (gate, long conv) x (N-1), final gate."""

    def __init__(self, config: HyenaConfig) -> None:
        super().__init__()
        d, self.order = config.d_model, config.order
        self.in_proj = nn.Linear(d, (self.order + 1) * d)
        # Depthwise and left-padded by kernel-1 (output trimmed to L) so it stays causal.
        self.short_conv = nn.Conv1d(
            (self.order + 1) * d,
            (self.order + 1) * d,
            config.short_kernel,
            groups=(self.order + 1) * d,
            padding=config.short_kernel - 1,
        )
        self.long_filter = ImplicitLongFilter(config, num_filters=self.order - 1)
        self.dropout = nn.Dropout(config.dropout)
        self.out_proj = nn.Linear(d, d)

    def forward(self, u: Tensor) -> Tensor:
        seq_len = u.shape[1]
        streams = self.in_proj(u).transpose(1, 2)  # (B, (N+1)D, L): convolutions run over the last dim
        streams = self.short_conv(streams)[..., :seq_len]
        *gates, v = streams.chunk(self.order + 1, dim=1)
        filters = self.long_filter(seq_len)
        for i, gate in enumerate(reversed(gates[1:])):
            v = self.dropout(v * gate)
            v = fft_causal_conv(v, filters[i], self.long_filter.skip[i])
        return self.out_proj((v * gates[0]).transpose(1, 2))


class HyenaBlock(nn.Module):
    """Pre-norm residual block: ``x + Hyena(LN(x))`` then ``x + MLP(LN(x))``."""

    def __init__(self, config: HyenaConfig) -> None:
        super().__init__()
        d = config.d_model
        self.norm_mixer, self.norm_mlp = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mixer = HyenaOperator(config)
        self.mlp = nn.Sequential(nn.Linear(d, config.mlp_ratio * d), nn.GELU(), nn.Linear(config.mlp_ratio * d, d))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.dropout(self.mixer(self.norm_mixer(x)))
        return x + self.dropout(self.mlp(self.norm_mlp(x)))


class HyenaDNA(nn.Module):
    """Next-nucleotide language model: token ids (B, L) -> logits (B, L, vocab_size)."""

    def __init__(self, config: HyenaConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(HyenaBlock(config) for _ in range(config.n_layer))
        self.norm_out = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.embedding.weight  # tied, as in HyenaDNA
        # GPT-2/HyenaDNA embedding init; nn.Embedding's N(0, 1) would make the tied head's
        # initial logits so large that the initial loss is ~10x log(vocab_size).
        nn.init.normal_(self.embedding.weight, std=0.02)

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.dropout(self.embedding(input_ids))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm_out(x))


def next_token_loss(logits: Tensor, input_ids: Tensor) -> Tensor:
    """Mean cross-entropy of predicting ``input_ids[:, 1:]`` from ``logits[:, :-1]``."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1))
