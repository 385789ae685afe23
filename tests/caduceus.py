"""A small Caduceus-style bidirectional Mamba DNA model, built on transformers' ``MambaModel``.

Caduceus (Schiff et al. 2024) makes Mamba bidirectional and reverse-complement
aware: its BiMamba runs the same (weight-tied) Mamba on a sequence and on the
sequence reversed and sums the two, so every position sees both sides.  This
module does that around a whole ``MambaModel`` backbone:

    hidden = Mamba(x) + flip(Mamba(reverse_complement(x)))  ->  tied LM head

The second pass reads the reverse complement (the opposite DNA strand, read in
its own 5'->3' direction: reversed, A<->T, C<->G), so the model also sees the
sequence as the other strand would present it; flipping its output back aligns
it with the forward positions.  Bidirectional models cannot be trained on the
next token, so it is trained as Caduceus is: masked language modelling (about
15% of the nucleotides replaced by ``[MASK]`` and predicted).

Tokens follow Caduceus' character tokenizer: 7 specials, then A, C, G, T, N
(a vocabulary of 12).

Reference:
    Schiff et al. 2024, "Caduceus: Bi-Directional Equivariant Long-Range DNA
    Sequence Modeling", ICML 2024, arXiv:2403.03234.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SPECIAL_TOKENS = ("[CLS]", "[SEP]", "[BOS]", "[MASK]", "[PAD]", "[RESERVED]", "[UNK]")
NUCLEOTIDES = ("A", "C", "G", "T", "N")
VOCAB = SPECIAL_TOKENS + NUCLEOTIDES  # 12 tokens
TOKEN_ID = {token: i for i, token in enumerate(VOCAB)}
MASK_ID = TOKEN_ID["[MASK]"]
COMPLEMENT = {"A": "T", "C": "G", "G": "C", "T": "A", "N": "N"}


def complement_table() -> Tensor:
    """Token id -> id of its complement (A<->T, C<->G; N and specials map to themselves)."""
    table = torch.arange(len(VOCAB))
    for base, other in COMPLEMENT.items():
        table[TOKEN_ID[base]] = TOKEN_ID[other]
    return table


def encode(sequence: str) -> Tensor:
    """A DNA string (``"ACGTN"``, case-insensitive) as token ids; other letters become ``[UNK]``."""
    return torch.tensor([TOKEN_ID.get(c, TOKEN_ID["[UNK]"]) for c in sequence.upper()])


class BiMambaDNA(nn.Module):
    """Bidirectional, reverse-complement-aware Mamba language model over nucleotides (Caduceus-style).

    One ``MambaModel`` backbone (embedding, Mamba blocks, final RMSNorm) runs on
    the input and on its reverse complement; the second result is flipped back
    and the two are summed, then a language-model head tied to the embedding
    gives logits of shape (batch, length, vocab).
    """

    def __init__(self, config) -> None:
        from transformers import MambaModel

        super().__init__()
        if config.vocab_size < len(VOCAB):
            raise ValueError(
                f"vocab_size must be at least {len(VOCAB)} (the nucleotide vocabulary), got {config.vocab_size}"
            )
        self.backbone = MambaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.backbone.embeddings.weight
        table = torch.arange(config.vocab_size)
        table[: len(VOCAB)] = complement_table()
        self.register_buffer("complement", table, persistent=False)

    def reverse_complement(self, input_ids: Tensor) -> Tensor:
        """The opposite strand of each sequence, read 5'->3': complemented and reversed."""
        return self.complement[input_ids].flip(-1)

    def forward(self, input_ids: Tensor) -> Tensor:
        forward_strand = self.backbone(input_ids=input_ids).last_hidden_state
        reverse_strand = self.backbone(input_ids=self.reverse_complement(input_ids)).last_hidden_state
        return self.lm_head(forward_strand + reverse_strand.flip(1))


def masked_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy over the masked positions (``labels`` is -100 elsewhere)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
