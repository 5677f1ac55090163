"""Final projection to vocabulary logits, one row per request."""

from __future__ import annotations

import torch
from torch import nn

from hiserve.layers.forward_batch import ForwardBatch
from hiserve.layers.linear import PackedLinear, linear


class LogitsProcessor(nn.Module):
    """Keeps the last new token of each request and applies the LM head.

    hidden_states: [T, H] (already final-normed); returns float32 [B, vocab].
    """

    def forward(
        self, hidden_states: torch.Tensor, lm_head_weight: torch.Tensor | PackedLinear,
        forward_batch: ForwardBatch
    ) -> torch.Tensor:
        if forward_batch.forward_mode.is_extend() and hidden_states.shape[0] != forward_batch.batch_size:
            last, acc = [], 0
            for n in forward_batch.extend_seq_lens_cpu:
                acc += n
                last.append(acc - 1)
            index = torch.tensor(last, dtype=torch.long, device=hidden_states.device)
            hidden_states = hidden_states.index_select(0, index)
        return linear(hidden_states, lm_head_weight).float()
