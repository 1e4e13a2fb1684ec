"""LoRA adapters through peft, and the merged weights that leave the trainer.

With ``TrainConfig.lora.enabled`` the trainer puts a low-rank adapter beside every targeted linear layer (Hu et al.
2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3) and trains the adapters only::

    h = W x + s · B A x        W [out, in] frozen,  A [r, in],  B [out, r] (zero at the start),  s = alpha / r

What leaves the trainer is always a plain model: ``Trainer.full_state_dict`` (the weights the RL stage pushes to the
rollout engine after every update) returns ``W' = W + s · B A`` under the base layer's own name (`merged_weights`),
and ``Trainer.close`` folds the adapters into the model the caller holds (`merge_lora`), so that model, saved with
``save_causal_lm``, is a checkpoint ``load_causal_lm`` reads with no peft at all.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from orchard._extras import requires_extra

__all__ = ["LORA_TARGETS", "LoraAdapters", "LoraConfig", "add_lora", "merge_lora", "merged_weights"]

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of Llama / Qwen / Mistral-style decoders (every linear layer but the lm head)."""

ADAPTER = "default"
"""peft's adapter name; the adapter weights are ``<module>.lora_A.default.weight`` and ``<module>.lora_B...``."""


@dataclass
class LoraConfig:
    """Low-rank adapters (peft) on the named linear layers; only the adapters train."""

    enabled: bool = False
    """Train LoRA adapters instead of every weight; the rollout engine and saved checkpoints get merged weights."""
    rank: int = 16
    """Rank r of each adapter (A is [r, in], B is [out, r])."""
    alpha: float = 32.0
    """Scale numerator: the update is (alpha / rank) · B A."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training (0 keeps an RL ratio exactly 1 before the first update)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Linear layers to adapt: a module whose name is an entry, or ends with '.' + an entry (peft's matching)."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled must be a bool, got {self.enabled!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank must be an int >= 1, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0 \
                or self.alpha == float("inf"):
            raise ValueError(f"alpha must be a finite number > 0, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) \
                or not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be a number in [0, 1), got {self.dropout!r}")
        targets = self.target_modules
        if not isinstance(targets, (list, tuple)) or not targets \
                or not all(isinstance(t, str) and t.strip(".") for t in targets):
            raise ValueError(f"target_modules must be a non-empty list of module names, got {targets!r}")
        if len(set(targets)) != len(targets):
            raise ValueError(f"target_modules must not repeat a name, got {targets!r}")


@dataclass
class LoraAdapters:
    """The adapters `add_lora` put into a model: peft's tuner (for `merge_lora`) and each adapted module's scale."""

    tuner: nn.Module
    """peft's ``LoraModel`` around the model (which it changed in place)."""
    scalings: dict[str, float]
    """``{module name in the model: s}`` for every adapted linear layer (s = alpha / rank)."""
    trainable: list[tuple[nn.Parameter, bool]]
    """Every parameter of the model before ``add_lora`` froze it, with its ``requires_grad`` then."""


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def add_lora(model: nn.Module, cfg: LoraConfig) -> LoraAdapters:
    """Put ``cfg``'s adapters into ``model`` in place (peft ``LoraModel``) and freeze every other parameter.

    ``model`` keeps its identity: its targeted ``nn.Linear`` layers become peft ``lora.Linear`` layers (the original
    layer as ``base_layer``), so its forward is the adapted policy and its parameter names gain ``.base_layer``,
    ``.lora_A.default`` and ``.lora_B.default`` parts until `merge_lora`.

    Raises:
        ValueError: naming ``target_modules`` for an entry that matches no module, a match that is not a linear
            layer, or a match whose weight another module shares (a lm head tied to the embedding); naming
            ``model`` when it already carries LoRA adapters (a trainer that added them was not closed).
    """
    if not isinstance(cfg, LoraConfig):
        raise ValueError(f"cfg must be a LoraConfig, got {type(cfg).__name__}")
    with requires_extra("train"):
        import peft
        from peft.tuners.lora import LoraLayer

    if any(isinstance(module, LoraLayer) for module in model.modules()):
        raise ValueError("model already carries LoRA adapters (close the Trainer that added them to merge them)")
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    matched: list[str] = []
    used: set[str] = set()
    for name, module in model.named_modules():
        hits = [t for t in cfg.target_modules if _matches(name, t)]
        if not hits:
            continue
        used.update(hits)
        if not isinstance(module, nn.Linear):
            raise ValueError(f"target_modules: {hits[0]!r} matches {name!r}, a {type(module).__name__}, not a "
                             "linear layer")
        if uses[id(module.weight)] > 1:
            raise ValueError(f"target_modules: {hits[0]!r} matches {name!r}, whose weight another module shares "
                             "(tied embeddings); its merged weight would change the other module too")
        matched.append(name)
    unused = [t for t in cfg.target_modules if t not in used]
    if unused:
        raise ValueError(f"target_modules: {unused} match no module of the model")
    trainable = [(param, param.requires_grad) for param in model.parameters()]
    peft_cfg = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=matched,
                               bias="none")
    tuner = peft.LoraModel(model, peft_cfg, ADAPTER)  # injects in place and freezes all but the adapters
    scalings = {name: float(module.scaling[ADAPTER]) for name, module in model.named_modules()
                if isinstance(module, LoraLayer)}
    return LoraAdapters(tuner=tuner, scalings=scalings, trainable=trainable)


def merged_weights(named: Iterable[tuple[str, Tensor]], scalings: dict[str, float]) -> dict[str, Tensor]:
    """Plain-model weights from an adapted model's parameters: ``W + s · B A`` under the base layer's name.

    Args:
        named: ``(name, tensor)`` pairs as the adapted model's ``named_parameters`` lists them, one at a time (a
            stream: each base weight is kept only until its module's ``B`` arrives).
        scalings: `LoraAdapters.scalings`, the scale ``s`` of every adapted module.

    Shapes: ``W [out, in]``, ``A [r, in]``, ``B [out, r]``; the product is taken in float32 and cast to ``W``'s
    dtype. ``<m>.base_layer.bias`` becomes ``<m>.bias``; every other parameter passes through unchanged.

    Raises:
        ValueError: when an adapted module's base weight, ``A`` or ``B`` is missing from ``named``.
    """
    out: dict[str, Tensor] = {}
    parts: dict[str, dict[str, Tensor]] = {}
    suffixes = {".base_layer.weight": "W", f".lora_A.{ADAPTER}.weight": "A", f".lora_B.{ADAPTER}.weight": "B"}
    for name, tensor in named:
        if name.endswith(".base_layer.bias"):
            out[name.removesuffix(".base_layer.bias") + ".bias"] = tensor
            continue
        suffix = next((s for s in suffixes if name.endswith(s)), None)
        if suffix is None:
            out[name] = tensor
            continue
        module = name.removesuffix(suffix)
        got = parts.setdefault(module, {})
        got[suffixes[suffix]] = tensor
        if len(got) == 3:
            W, A, B = got["W"], got["A"], got["B"]  # [out, in], [r, in], [out, r]
            delta = scalings[module] * (B.float() @ A.float())  # [out, in]
            out[module + ".weight"] = (W.float() + delta).to(W.dtype)
            del parts[module]
    if parts:
        missing = {m: sorted({"W", "A", "B"} - set(p)) for m, p in parts.items()}
        raise ValueError(f"named lacks parts of adapted modules (W: base weight): {missing}")
    return out


def merge_lora(adapters: LoraAdapters) -> nn.Module:
    """Fold the adapters into their base layers in place (``W <- W + s · B A``) and take peft out of the model:
    the model ``add_lora`` was given is a plain model again, with its original parameter names and each
    parameter's ``requires_grad`` as it was before ``add_lora``; it is returned."""
    with torch.no_grad():
        model = adapters.tuner.merge_and_unload()
    for param, requires_grad in adapters.trainable:
        param.requires_grad_(requires_grad)
    return model
