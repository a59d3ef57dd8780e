"""The dynamic audit (``fsdp_compat.audit.audit_raw_reads``), the ground truth the static analysis is tested against:
one real forward and backward of the unsharded model, every parameter used while its owner is not executing. The
expected reads come from the models' source (transformers' and the zoo's forwards)."""

from __future__ import annotations

import torch
from torch import nn

from fsdp_compat.audit import audit_raw_reads
from fsdp_compat.testing.zoo import build_model, make_batch


def _reads(name: str) -> set[tuple[str, str, str]]:
    return {(r.reader, r.owner, r.param) for r in audit_raw_reads(build_model(name), **make_batch(name))}


def test_glm4v_position_table_is_read_by_the_embeddings_module() -> None:
    """``Glm4vVisionEmbeddings.forward`` reads ``self.position_embedding.weight`` (it interpolates the table) and never
    calls the table's own forward."""
    table = "model.visual.embeddings.position_embedding"
    assert ("model.visual.embeddings", table, f"{table}.weight") in _reads("glm4v")


def test_qwen2_uses_every_parameter_inside_its_owners_forward() -> None:
    """Qwen2 (untied) calls every module that holds a parameter: nothing is read from outside."""
    assert _reads("qwen2") == set()


def test_head_weight_read_by_the_root_is_seen_whether_or_not_the_head_ran() -> None:
    """The zoo's qwen2-fused-lmhead computes ``F.linear(hidden, self.lm_head.weight)`` in the root; qwen2-zloss calls
    ``self.lm_head`` and then reads its weight for the penalty. Both are root reads of ``lm_head.weight``."""
    assert _reads("qwen2-fused-lmhead") == {("", "lm_head", "lm_head.weight")}
    assert _reads("qwen2-zloss") == {("", "lm_head", "lm_head.weight")}


class _Shared(nn.Module):
    """``a`` and ``b`` hold one Parameter; each uses it in its own forward. The root reads ``c.weight`` raw during
    forward, and ``a`` reads nothing of another module."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.b(self.a(x)) @ self.c.weight).sum()


def test_a_sharer_using_its_own_parameter_is_not_a_read() -> None:
    reads = audit_raw_reads(_Shared(), torch.randn(2, 3))
    assert [(r.reader, r.owner, r.param, r.kind) for r in reads] == [("", "c", "c.weight", "raw-read")]
    assert "test_audit.py" in reads[0].location and "forward" in reads[0].location
