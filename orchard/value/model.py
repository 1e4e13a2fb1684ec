"""``ValueModel``: a causal-LM backbone whose LM head is replaced by a scalar value head (layer 5).

``V(s_t)`` for decision step ``t`` is the head's output at the step's last token (``orchard.value.steps``). The
backbone is any ``AutoModel`` (the causal LM without its head); it loads from a causal-LM checkpoint (its LM head
weights are ignored) or from a config, and a ``ValueModel`` saves as that backbone checkpoint plus
``value_head.safetensors`` and ``orchard_value.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from orchard._extras import requires_extra

with requires_extra("train"):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModel, PretrainedConfig, PreTrainedModel

from orchard.value.steps import gather_step_values

__all__ = ["ValueModel"]

_HEAD_FILE = "value_head.safetensors"
_META_FILE = "orchard_value.json"


class ValueModel(nn.Module):
    """Scalar value per token from a transformer backbone: ``v_t = w · h_t + b`` on the last hidden state.

    Args:
        backbone: a transformers base model (``AutoModel``), returning ``last_hidden_state`` ``[B, T, H]``.
        head: optional ``nn.Linear(H, 1)``; default a new one, weights ~ N(0, 1/H) and bias 0, seeded by ``seed``.
        seed: torch seed of the new head's initialisation (the global RNG is untouched).
    """

    def __init__(self, backbone: PreTrainedModel, head: nn.Linear | None = None, *, seed: int = 0) -> None:
        super().__init__()
        if not isinstance(backbone, PreTrainedModel):
            raise ValueError(f"backbone must be a transformers PreTrainedModel, got {type(backbone).__name__}")
        hidden = int(backbone.config.hidden_size)
        if head is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                head = nn.Linear(hidden, 1)
                nn.init.normal_(head.weight, std=hidden**-0.5)
                nn.init.zeros_(head.bias)
            head = head.to(next(backbone.parameters()).dtype)
        if not isinstance(head, nn.Linear) or head.in_features != hidden or head.out_features != 1:
            raise ValueError(f"head must be nn.Linear({hidden}, 1), got {head!r}")
        self.backbone = backbone
        self.value_head = head

    @property
    def config(self) -> PretrainedConfig:
        """The backbone's config."""
        return self.backbone.config

    @classmethod
    def from_config(cls, config: PretrainedConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> ValueModel:
        """Random weights from a (causal-LM or base) config, deterministic for ``seed``."""
        if not isinstance(config, PretrainedConfig):
            raise ValueError(f"config must be a PretrainedConfig, got {type(config).__name__}")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            backbone = AutoModel.from_config(config, dtype=dtype)
        return cls(backbone.to(dtype), seed=seed)

    @classmethod
    def from_causal_lm(cls, model: PreTrainedModel, *, seed: int = 0) -> ValueModel:
        """Take the backbone of a loaded causal LM (shares its weights; the LM head is dropped)."""
        if not isinstance(model, PreTrainedModel):
            raise ValueError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
        return cls(model.base_model, seed=seed)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, **kwargs: Any
    ) -> ValueModel:
        """Load a saved ``ValueModel``, or start one from any causal-LM checkpoint directory or named pretrained
        checkpoint (new head).

        ``kwargs`` go to ``AutoModel.from_pretrained`` (e.g. ``attn_implementation``); nothing is downloaded.
        """
        from orchard.models.pretrained import PRETRAINED, resolve_checkpoint

        directory = resolve_checkpoint(path) if isinstance(path, str) and path in PRETRAINED else Path(path)
        if not directory.is_dir():
            raise ValueError(f"path must be a local checkpoint directory or a named checkpoint, got {str(directory)!r}")
        kwargs.setdefault("local_files_only", True)
        backbone = AutoModel.from_pretrained(directory, dtype=dtype, **kwargs)
        head_file = directory / _HEAD_FILE
        if not head_file.is_file():
            return cls(backbone, seed=seed)
        state = load_file(str(head_file))
        head = nn.Linear(int(backbone.config.hidden_size), 1).to(dtype)
        head.load_state_dict({k: v.to(dtype) for k, v in state.items()})
        return cls(backbone, head)

    def save_pretrained(self, path: str | Path) -> None:
        """Write the backbone checkpoint, the head and a marker file to directory ``path``."""
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(directory)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.value_head.state_dict().items()},
                  str(directory / _HEAD_FILE))
        (directory / _META_FILE).write_text(json.dumps({"head": "linear", "hidden_size": self.value_head.in_features}))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Per-token values ``[B, T]`` (float32)."""
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
            got = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be a tensor of shape [B, T], got {got}")
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, T, H]
        return self.value_head(hidden).squeeze(-1).float()  # [B, T]

    def step_values(
        self, input_ids: Tensor, attention_mask: Tensor | None, turn_index: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Values of the decision steps, read at each step's last token: ``([B, S] values, [B, S] step mask)``."""
        return gather_step_values(self(input_ids, attention_mask), turn_index)


