"""The static analysis (``fsdp_compat.analysis``) against the dynamic audit on every zoo model, both ways: every read
the audit sees is in the static evidence, and every group the plan withholds because of a read is one the audit sees
read outside its forward; and the evidence the plan repair relies on (which forward came before a read).
"""

from __future__ import annotations

import pytest

import fsdp_compat
from fsdp_compat.analysis import find_raw_reads
from fsdp_compat.testing.zoo import ZOO, build_model, make_batch

ZOO_NAMES = sorted(ZOO)


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_static_analysis_finds_every_raw_read_the_audit_sees(name: str) -> None:
    model = build_model(name)
    static = {(e.reader, e.param) for e in fsdp_compat.plan_wrap(model).evidence if e.kind == "raw-read"}
    observed = {(r.reader, r.param) for r in fsdp_compat.audit_raw_reads(model, **make_batch(name))}
    print(f"{name}: audit {sorted(observed)}; static {len(static)} reads")
    assert observed <= static, f"missed by static analysis: {observed - static}"


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_every_group_the_plan_withholds_is_one_the_audit_sees_read(name: str) -> None:
    """The other direction (static evidence that costs sharding, checked against the audit): each candidate kept out
    of its own group, or kept unsharded until backward, because of a read is one whose parameters the audit sees used
    outside its forward. Explained exceptions: sharers kept together (an identity fact, not a read)."""
    from fsdp_compat.tree import ModuleTree

    model = build_model(name)
    tree = ModuleTree.build(model)
    plan = fsdp_compat.plan_wrap(model)
    observed = fsdp_compat.audit_raw_reads(model, **make_batch(name))
    owners = {r.owner for r in observed}
    withheld = [e.path for e in plan.root if "shares a Parameter" not in e.reason]
    withheld += [g.paths[0] for g in plan.groups if g.overrides.get("reshard_after_forward") is False]
    print(f"{name}: withheld {withheld}; audit owners {sorted(owners)}")
    for path in withheld:
        assert any(tree.is_ancestor_or_self(path, owner) for owner in owners), f"{path} withheld, never read raw"
    if name.startswith("glm4v"):
        table = "model.visual.embeddings.position_embedding"
        assert ("model.visual.embeddings", f"{table}.weight") in {(r.reader, r.param) for r in observed}
        assert table in withheld


def test_glm4v_position_table_read_is_evidence_of_the_embeddings_module():
    """transformers' ``Glm4vVisionEmbeddings.forward`` reads ``self.position_embedding.weight`` and never calls the
    table: the static evidence names that read, with the embeddings module as the reader."""
    model = build_model("glm4v")
    reads = {(e.reader, e.owner, e.param) for e in find_raw_reads(model).events if e.kind == "raw-read"}
    table = "model.visual.embeddings.position_embedding"
    assert ("model.visual.embeddings", table, f"{table}.weight") in reads


def test_read_after_the_heads_forward_records_that_forward():
    """The zoo's qwen2-zloss forward calls ``self.lm_head(hidden)`` and then reads ``self.lm_head.weight`` in the
    root; qwen2-fused-lmhead reads it without ever calling ``lm_head``. Only the first read is after lm_head's
    forward (what lets a plan keep lm_head's group unsharded instead of dropping it)."""
    (zloss,) = [e for e in find_raw_reads(build_model("qwen2-zloss")).events if e.param == "lm_head.weight"]
    (fused,) = [e for e in find_raw_reads(build_model("qwen2-fused-lmhead")).events if e.param == "lm_head.weight"]
    assert (zloss.reader, zloss.kind, fused.reader, fused.kind) == ("", "raw-read", "", "raw-read")
    assert "lm_head" in zloss.after_forward_of
    assert "lm_head" not in fused.after_forward_of


def test_analysis_modules_share_only_public_names():
    """One module of the analysis may use what another defines, by its public name: a ``_name`` stays private to
    the module that defines it (the package's modules once imported 36 of each other's private names)."""
    import ast
    from pathlib import Path

    import fsdp_compat.analysis as package

    private = []
    for source in sorted(Path(package.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsdp_compat"):
                private += [f"{source.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert private == []
