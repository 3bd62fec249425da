"""A plain nanoGPT-style GPT-2 in PyTorch: the yardstick for our single-process overhead.

Same shape as our GPTModel with the benchmark's flags (learned positions, pre-LayerNorm blocks, fused
QKV, causal ``scaled_dot_product_attention``, 4h GELU MLP, final LayerNorm, untied output layer, no
dropout) and the training step a PyTorch user writes: forward, mean cross entropy, backward per
micro-batch, clip the global gradient norm, AdamW. Nothing else: no hooks, no bookkeeping.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """LayerNorm -> causal self-attention -> residual; LayerNorm -> MLP -> residual."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.fc_out = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h]
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(hidden, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2)
                   for t in (q, k, v))  # [b, heads, s, hn]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class PlainGPT(nn.Module):
    """GPT-2 language model returning the mean next-token cross entropy."""

    def __init__(self, vocab: int, seq: int, hidden: int, heads: int, layers: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        for name, param in self.named_parameters():
            if param.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight",
                                                                       "fc_out.weight")) else 0.02
                nn.init.normal_(param, std=std)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class PlainTraining:
    """The plain model and its training step on fixed micro-batches (dicts with tokens, labels)."""

    def __init__(self, config, microbatches: list):
        model = config.model
        self.model = PlainGPT(model.padded_vocab_size, model.seq_length, model.hidden_size,
                              model.num_attention_heads, model.num_layers, config.training.seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.optimizer.lr,
                                           weight_decay=config.optimizer.weight_decay)
        self.clip_grad = config.optimizer.clip_grad
        self.microbatches = microbatches
        self.description = "plain nanoGPT-style model, AdamW, clip_grad_norm_"

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for batch in self.microbatches:
            loss = self.model(batch["tokens"], batch["labels"]) / len(self.microbatches)
            loss.backward()
        if self.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad)
        self.optimizer.step()
