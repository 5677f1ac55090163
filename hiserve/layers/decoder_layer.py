"""The pre-norm residual block shared by the decoder models (Llama, DeepSeek-V2)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from hiserve.layers.forward_batch import ForwardBatch


class PreNormDecoderLayer(nn.Module):
    """x -> attn(norm(x)) + x -> mlp(norm(.)) + ., with the residual add fused into the
    next norm (RMSNorm(x, residual) returns the normed sum and the sum).

    Subclasses set `self_attn`, `mlp`, `input_layernorm` and `post_attention_layernorm`.
    Forward: hidden_states [T, H], residual [T, H] or None (first layer); returns the MLP
    output and the residual stream, both [T, H].
    """

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module

    def forward(self, hidden_states: torch.Tensor, residual: Optional[torch.Tensor], cos_sin: object,
                rotary: nn.Module, forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, cos_sin, rotary, forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual
