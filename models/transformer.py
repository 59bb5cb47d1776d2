"""Decoder-only GPT-style language model (pre-LayerNorm, learned positions, tied head).

`activation_checkpointing=True` trades compute for memory: in training each Block keeps only
its input, and recomputes its activations during the backward pass (torch.utils.checkpoint,
non-reentrant). Gradients are unchanged; a step costs about one extra forward of the blocks,
and activation memory drops from every block's intermediates to one block's plus the block
inputs. Use it when a batch or context does not fit otherwise.

`position_ids` (B, T), optional, give each token's position, for rows that pack several
examples end to end (data/packing.py): positions restart at 0 where an example begins, and
attention stays inside each example (a block-diagonal causal mask). Without them every row is
one sequence, and attention takes SDPA's is_causal fast path.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass
class TransformerConfig:
    """The model's shape, checked; `Transformer(**fields)` builds it (defaults live there)."""

    vocab_size: int  # from the data set: the vocabulary of the text or token file
    block_size: int  # longest context the model accepts (size of the position table)
    n_layers: int
    n_heads: int
    d_model: int
    d_ff: int  # hidden width of each MLP; 0 means 4 * d_model
    dropout: float
    bias: bool  # biases in the Linear layers and LayerNorms
    tie_weights: bool  # lm_head shares the token embedding matrix
    activation_checkpointing: bool = False  # recompute each Block's activations in backward

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layers", "n_heads", "d_model"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"model.{name}={value!r} must be a positive integer; use 1 or more")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model={self.d_model} must be divisible by model.n_heads={self.n_heads}; "
                f"pick sizes where d_model % n_heads == 0"
            )
        if not _is_int(self.d_ff) or self.d_ff < 0:
            raise ValueError(
                f"model.d_ff={self.d_ff!r} must be a non-negative integer; use 0 for 4 * d_model"
            )
        is_number = isinstance(self.dropout, (int, float)) and not isinstance(self.dropout, bool)
        if not is_number or not 0 <= self.dropout < 1:
            raise ValueError(
                f"model.dropout={self.dropout!r} must be in [0, 1); use 0.0 to disable dropout"
            )
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(
                f"model.activation_checkpointing={self.activation_checkpointing!r} must be true or false"
            )

    @property
    def ff_width(self) -> int:
        return self.d_ff or 4 * self.d_model


def _is_int(value: object) -> bool:
    # bool is an int subclass, but True is never meant as a size.
    return isinstance(value, int) and not isinstance(value, bool)


def packed_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool for SDPA: query t sees key s when s <= t and both are in the same
    example. An example begins wherever a position is not the previous one plus one, the rule
    transformers' find_packed_sequence_indices reads packed position_ids by."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    example = starts.cumsum(dim=1)  # (B, T): the example each token belongs to
    T = position_ids.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
    return ((example[:, :, None] == example[:, None, :]) & causal).unsqueeze(1)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only attends to positions <= t."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.dropout = config.dropout
        # One fused projection: a single matmul for q, k and v is faster than three.
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """mask: (B, 1, T, T) bool, True where a query may attend to a key; None: causal."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim): SDPA batches over the leading dims.
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=mask is None
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: d_model -> d_ff -> d_model."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.d_model, config.ff_width, bias=config.bias)
        self.gelu = nn.GELU()
        self.fc_out = nn.Linear(config.ff_width, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(self.gelu(self.fc_in(x))))


class Block(nn.Module):
    """Pre-LayerNorm block: normalising inside the residual branch keeps deep stacks stable."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        x = x + self.mlp(self.ln2(x))
        return x


class Transformer(nn.Module):
    """Token + position embeddings, n_layers Blocks, final LayerNorm, linear head to logits."""

    def __init__(
        self,
        vocab_size: int,
        block_size: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        d_model: int = 128,
        d_ff: int = 0,
        dropout: float = 0.1,
        bias: bool = True,
        tie_weights: bool = True,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.config = config = TransformerConfig(
            vocab_size, block_size, n_layers, n_heads, d_model, d_ff, dropout, bias, tie_weights,
            activation_checkpointing,
        )
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.block_size, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_weights:
            # The same Parameter object: one matrix both embeds tokens and scores them.
            self.lm_head.weight = self.token_embedding.weight
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        # GPT-2: each block adds two residual branches, so scale their output projections down
        # by sqrt(2 * n_layers) to keep the residual stream's variance independent of depth.
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.fc_out.weight, mean=0.0, std=residual_std)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: (B, T) token ids, T <= block_size -> logits (B, T, vocab_size).
        position_ids: (B, T), for packed rows (module docstring); None: 0 .. T - 1.
        Keyword names as Hugging Face's, so a dict batch calls model(**batch)."""
        if input_ids.dim() != 2:
            raise ValueError(f"expected token ids of shape (B, T), got shape {tuple(input_ids.shape)}")
        T = input_ids.size(1)
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds model.block_size={self.config.block_size}; "
                f"feed at most block_size tokens (crop the context) or raise model.block_size"
            )
        if position_ids is None:
            positions, mask = torch.arange(T, device=input_ids.device), None
        else:
            positions, mask = position_ids, packed_causal_mask(position_ids)
        x = self.dropout(self.token_embedding(input_ids) + self.position_embedding(positions))
        recompute = self.config.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            # Non-reentrant: works with torch.compile, DDP and inputs that need no grad, and
            # replays dropout with the RNG state of the forward, so gradients are exact.
            x = checkpoint(block, x, mask, use_reentrant=False) if recompute else block(x, mask)
        return self.lm_head(self.ln_f(x))

    def num_parameters(self, exclude_embeddings: bool = True) -> int:
        """Trainable parameter count, each shared tensor once.

        With exclude_embeddings, drop the tables that are only looked up (positions, and the
        token table unless it is tied to lm_head, where it does a real matmul): that is the N
        of the 6N FLOPs-per-token estimate.
        """
        total = sum(p.numel() for p in self.parameters())  # parameters() yields a tied tensor once
        if exclude_embeddings:
            total -= self.position_embedding.weight.numel()
            if self.lm_head.weight is not self.token_embedding.weight:
                total -= self.token_embedding.weight.numel()
        return total

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward), the PaLM / nanoGPT estimate for MFU:
        6N for the matmuls with the weights, plus 12 * n_layers * d_model * block_size for
        attention scores and their weighted sums at full context."""
        c = self.config
        return 6 * self.num_parameters(exclude_embeddings=True) + 12 * c.n_layers * c.d_model * c.block_size
