"""bf16 linear layers whose weights are reordered for oneDNN once, not on every CPU forward.

torch's bf16 `linear` on CPU hands oneDNN the weight in its plain layout, and oneDNN reorders it
into its blocked layout on every call. At a decode step's few dozen rows that reorder reads and
writes every weight once more per step (docs/results/step_speed.md has the figures). Reordering
once, and again only when the weights change, runs the same kernel on the same blocks.

`PackedLinear` keeps the module's own `weight` (and `bias`) Parameters, so parameter names, the
state dict, tied embeddings and in-place weight updates (`rljob.weights`) see no difference; an
in-place write bumps the weight's version counter, and the next forward reorders again. A
single-row input takes torch's plain path, which computes it differently (a matrix-vector kernel),
and so does a weight made under inference mode, which has no version counter.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

ROWS_HINT = 64  # the batch size oneDNN chooses the blocked layout for: a decode step's rows


def packing_supported(weight: torch.Tensor) -> bool:
    """oneDNN bf16 on this CPU, with the private ops torch's own compiler uses for prepacked weights
    (torch's plain bf16 linear has a fallback where oneDNN has no bf16 kernel; these ops do not)."""
    ops = torch.ops.mkldnn
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and all(
            hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise", "_is_mkldnn_bf16_supported")
        )
        and ops._is_mkldnn_bf16_supported()
    )


class PackedLinear(torch.nn.Linear):
    """An inference-only `nn.Linear` over another's Parameters, with their oneDNN-ordered copy."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        torch.nn.Module.__init__(self)  # not Linear's: the Parameters are the given module's own
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        # (weight, its version, the reordered copy): the tensor itself, not its id, which a
        # replacement could reuse.
        self._packing: tuple[torch.Tensor, int, torch.Tensor] | None = None

    def __getstate__(self) -> dict:
        # oneDNN's reordered tensor is opaque (no storage to copy or pickle): copies reorder anew.
        return {**self.__dict__, "_packing": None}

    def _current_packing(self) -> torch.Tensor:
        packing = self._packing
        if packing is None or packing[0] is not self.weight or packing[1] != self.weight._version:
            with torch.no_grad():
                reordered = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), ROWS_HINT)
            packing = self._packing = (self.weight, self.weight._version, reordered)
        return packing[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plain = torch.is_grad_enabled() or x.dtype != torch.bfloat16 or x.numel() <= x.shape[-1]
        if plain or self.weight.is_inference():  # an inference tensor has no version counter to watch
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._current_packing(), self.bias, "none", [], "")


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every bf16 CPU `nn.Linear` of `model` by a `PackedLinear` over the same Parameters;
    returns how many were replaced (0 where oneDNN cannot take them)."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear and packing_supported(child.weight)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    if swaps:
        log.info("bf16 linear layers with weights reordered once for oneDNN: %d", len(swaps))
    return len(swaps)
