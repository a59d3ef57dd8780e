"""The module-tree index (``fsdp_compat.tree``): repeated layer classes on a zoo model, answered from the model's
definition in transformers, and the index's ancestry and sharing questions on small trees whose answers are plain."""

from __future__ import annotations

from torch import nn

from fsdp_compat.testing.zoo import build_model
from fsdp_compat.tree import ModuleTree, repeated_block_classes


def test_glm4v_repeated_blocks_are_its_vision_blocks_and_decoder_layers() -> None:
    """transformers' modeling_glm4v: ``Glm4vVisionModel.blocks`` is a ModuleList of ``Glm4vVisionBlock`` (``depth``),
    ``Glm4vTextModel.layers`` one of ``Glm4vTextDecoderLayer`` (``num_hidden_layers``); nothing else repeats."""
    model = build_model("glm4v")
    assert model.config.vision_config.depth >= 2 and model.config.text_config.num_hidden_layers >= 2
    assert repeated_block_classes(model) == ["Glm4vTextDecoderLayer", "Glm4vVisionBlock"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)


class Other(Block):
    pass


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block(), Other()])  # Block repeats, Other does not
        self.single = nn.ModuleList([nn.Identity()])
        self.head = nn.Linear(2, 2)
        self.tail = nn.Linear(2, 2)
        self.tail.weight = self.head.weight  # one Parameter, two holders


def test_only_classes_repeated_in_module_lists_or_declared_count() -> None:
    tower = Tower()
    assert repeated_block_classes(tower) == ["Block"]
    tower._no_split_modules = ["Other", None]  # type: ignore[assignment]  # declared names count, non-strings not
    assert repeated_block_classes(tower) == ["Block", "Other"]


def test_ancestry_questions() -> None:
    tree = ModuleTree.build(Tower())
    assert list(tree.ancestors("blocks.0.proj")) == ["blocks.0", "blocks", ""]
    assert tree.lca("blocks.0.proj", "blocks.2") == "blocks"
    assert tree.lca("blocks.0", "head") == ""
    assert tree.is_ancestor_or_self("blocks", "blocks.1.proj") and tree.is_ancestor_or_self("", "head")
    assert not tree.is_ancestor_or_self("blocks.1", "blocks.10")  # a prefix of the name is not an ancestor
    assert tree.path_between("blocks.0.proj", "", include_low=True) == ["blocks.0.proj", "blocks.0", "blocks"]
    assert tree.depth("") == 0 and tree.depth("blocks.0.proj") == 3
    order = tree.post_order
    assert order["blocks.0.proj"] < order["blocks.0"] < order["blocks"] < order[""]  # children before parents


def test_shared_parameters_are_indexed_once_with_every_holder() -> None:
    tower = Tower()
    tree = ModuleTree.build(tower)
    assert tree.param_owners[id(tower.head.weight)] == [("head", "weight"), ("tail", "weight")]
    names = [name for name, _ in tree.subtree_params("")]
    assert "head.weight" in names and "tail.weight" not in names  # the one object, once
    assert tree.below_common_ancestor(["head", "tail"]) == ["head", "tail"]
    assert tree.direct_param_count("head") == 2 * 2 + 2 and tree.direct_param_count("blocks") == 0


def test_tied_glm4v_head_and_input_table_hold_one_parameter() -> None:
    """``tie_word_embeddings=True``: transformers ties ``lm_head.weight`` to the input embedding's weight."""
    model = build_model("glm4v-tied")
    tree = ModuleTree.build(model)
    holders = {path for path, _ in tree.param_owners[id(model.lm_head.weight)]}
    assert holders == {"lm_head", "model.language_model.embed_tokens"}
