import pytest

from fp4kit.recipe import RecipeError, available_recipes, load_recipe, recipe_from_dict

BASE = {"name": "r", "rules": [{"roles": ["routed_experts"], "format": "nvfp4_w4a16", "scale_rule": "4o6"}]}


def with_(**changes):
    d = {k: (list(v) if isinstance(v, list) else v) for k, v in BASE.items()}
    d.update(changes)
    return d


@pytest.mark.parametrize("name", sorted(available_recipes()))
def test_shipped_recipes_validate_and_round_trip(name, tmp_path):
    recipe = load_recipe(name)
    path = tmp_path / f"{name}.yaml"
    path.write_text(recipe.to_yaml())
    again = load_recipe(str(path))
    assert again == recipe


def test_default_recipe_is_the_lightning_card():
    r = load_recipe("nemotron-h-w4a16-4o6")
    assert r.kv_cache == "fp8"
    experts = r.rule_for("routed_experts", "backbone.layers.1.mixer.experts.0.up_proj")
    assert experts.format == "nvfp4_w4a16" and experts.scale_rule == "4o6"
    assert r.rule_for("shared_experts", "backbone.layers.1.mixer.shared_experts.up_proj").format == "nvfp4_w4a16"
    assert r.rule_for("mamba_in_proj", "backbone.layers.0.mixer.in_proj").format == "fp8"
    for role in ("attention_qkv", "attention_o", "router", "conv1d", "lm_head", "embeddings"):
        assert r.rule_for(role, "x") is None
    assert r.rule_for("mtp", "mtp.layers.0.mixer.q_proj") is None  # the MTP subtree stays BF16
    assert r.rule_for("mamba_in_proj", "backbone.layers.0.mixer.in_proj").amax_search == ()  # max|W|
    lightning = load_recipe("modelopt-lightning")
    assert lightning.rule_for("routed_experts", "mtp.layers.0.mixer.experts.0.up_proj") is None  # excluded subtree
    # ModelOpt's Lightning recipe runs its `mse` range search on the FP8 weights too.
    assert lightning.rule_for("mamba_out_proj", "backbone.layers.0.mixer.out_proj").amax_search == (1.0, 1.5)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (with_(colour="red"), r"unknown key\(s\) \['colour'\]"),
        (with_(rules=[{"roles": ["experts"], "format": "nvfp4_w4a16"}]), r"unknown role\(s\) \['experts'\]"),
        (with_(rules=[{"roles": ["lm_head"], "format": "int4"}]), "format must be one of"),
        (with_(rules=[{"roles": ["lm_head"], "format": "fp8", "scale_rule": "4o6"}]), "apply to nvfp4 formats only"),
        (with_(rules=[{"roles": ["lm_head"], "format": "nvfp4", "scale_rule": "5"}]), "scale_rule must be"),
        (with_(rules=[{"roles": ["lm_head"], "format": "nvfp4", "importance": True}]), "needs scale_rule '4o6'"),
        (with_(rules=[{"roles": ["lm_head"], "format": "nvfp4", "amax_search": [1.0, 1.5]}]), "applies to the fp8 format only"),
        (with_(rules=[{"roles": ["lm_head"], "format": "fp8", "amax_search": [1.0, -1.5]}]), "positive numbers"),
        (with_(rules=[{"roles": ["lm_head"], "format": "fp8", "amax_search": "1.5"}]), "positive numbers"),
        (with_(rules=[{"format": "nvfp4"}]), "needs `roles` or `names`"),
        (with_(rules=[{"roles": ["lm_head"], "format": "nvfp4", "typo": 1}]), r"unknown key\(s\) \['typo'\]"),
        (with_(rules=[]), "non-empty list"),
        (with_(version=2), "version 2 is not supported"),
        (with_(kv_cache="int8"), "kv_cache must be one of"),
        (with_(name=""), "`name` must be"),
        ([1, 2], "mapping at the top level"),
    ],
)
def test_bad_recipes_are_rejected_with_the_reason(data, message):
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict(data)


def test_unknown_recipe_name_and_bad_yaml(tmp_path):
    with pytest.raises(RecipeError, match="unknown recipe 'nope'"):
        load_recipe("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(str(bad))


def test_first_matching_rule_wins_and_names_select():
    r = recipe_from_dict(
        {
            "name": "x",
            "rules": [
                {"names": ["*.layers.1.*"], "format": "bf16"},
                {"roles": ["routed_experts"], "format": "nvfp4", "scale_rule": "6"},
            ],
        }
    )
    assert r.rule_for("routed_experts", "backbone.layers.1.mixer.experts.0.up_proj") is None
    assert r.rule_for("routed_experts", "backbone.layers.3.mixer.experts.0.up_proj").format == "nvfp4"
