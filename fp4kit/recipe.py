"""Recipes: which format each role (or named module) is stored in.

A recipe is a versioned YAML file under configs/ (or any path), validated strictly: unknown keys,
unknown roles, unknown formats and options that do not apply to a format are errors.

    name: nemotron-h-w4a16-4o6
    version: 1
    description: ...
    kv_cache: fp8                     # fp8 | none
    rules:                            # first matching rule wins; unmatched weights stay BF16
      - roles: [routed_experts, shared_experts]
        format: nvfp4_w4a16           # nvfp4_w4a16 | nvfp4 | fp8 | bf16
        scale_rule: 4o6               # nvfp4 formats: "6" | "4o6"
        importance: false             # nvfp4 4o6: weight the 4/6 choice by E[x^2] per input channel
      - roles: [mamba_in_proj, mamba_out_proj]
        format: fp8
        amax_search: [1.0, 1.5]       # fp8: ModelOpt's `mse` range search (optional; default max|W|)
    exclude: ["mtp.*"]                # checkpoint-name globs kept BF16 whatever the rules say
"""

from __future__ import annotations

import fnmatch
import importlib.resources
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .models.roles import ROLE_NAMES

RECIPE_VERSION = 1
FORMATS = ("nvfp4_w4a16", "nvfp4", "fp8", "bf16")
# quant_algo as ModelOpt writes it, per format
QUANT_ALGO = {"nvfp4_w4a16": "W4A16_NVFP4", "nvfp4": "NVFP4", "fp8": "FP8"}
KV_CACHE = ("fp8", "none")
DEFAULT_RECIPE = "nemotron-h-w4a16-4o6"


class RecipeError(ValueError):
    """A recipe file or dict that does not validate."""


@dataclass(frozen=True)
class Rule:
    format: str
    roles: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    scale_rule: str = "6"
    importance: bool = False
    amax_search: tuple[float, ...] = ()

    def matches(self, role: str, disk_name: str) -> bool:
        if self.roles and role not in self.roles:
            return False
        if self.names and not any(fnmatch.fnmatchcase(disk_name, p) for p in self.names):
            return False
        return True


@dataclass(frozen=True)
class Recipe:
    name: str
    rules: tuple[Rule, ...]
    version: int = RECIPE_VERSION
    description: str = ""
    kv_cache: str = "none"
    exclude: tuple[str, ...] = ()
    source: str = field(default="", compare=False)

    def rule_for(self, role: str, disk_name: str) -> Rule | None:
        """The rule that decides this weight, or None (BF16)."""
        if any(fnmatch.fnmatchcase(disk_name, p) for p in self.exclude):
            return None
        for rule in self.rules:
            if rule.matches(role, disk_name):
                return None if rule.format == "bf16" else rule
        return None

    def to_dict(self) -> dict:
        d = {
            "name": self.name,
            "version": self.version,
            "description": self.description,
            "kv_cache": self.kv_cache,
            "rules": [],
            "exclude": list(self.exclude),
        }
        for r in self.rules:
            rd: dict = {"format": r.format}
            if r.roles:
                rd["roles"] = list(r.roles)
            if r.names:
                rd["names"] = list(r.names)
            if r.format.startswith("nvfp4"):
                rd["scale_rule"] = r.scale_rule
                rd["importance"] = r.importance
            if r.amax_search:
                rd["amax_search"] = list(r.amax_search)
            d["rules"].append(rd)
        return d

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


_RECIPE_KEYS = {"name", "version", "description", "kv_cache", "rules", "exclude"}
_RULE_KEYS = {"roles", "names", "format", "scale_rule", "importance", "amax_search"}


def _str_list(value, what: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise RecipeError(f"{what} must be a list of non-empty strings, got {value!r}")
    return tuple(value)


def _check_keys(d: dict, allowed, where: str) -> None:
    unknown = set(d) - allowed
    if unknown:
        raise RecipeError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")


def _parse_rule(d, where: str) -> Rule:
    if not isinstance(d, dict):
        raise RecipeError(f"{where}: a rule must be a mapping, got {d!r}")
    _check_keys(d, _RULE_KEYS, where)
    fmt = d.get("format")
    if fmt not in FORMATS:
        raise RecipeError(f"{where}: format must be one of {FORMATS}, got {fmt!r}")
    roles = _str_list(d["roles"], f"{where}.roles") if "roles" in d else ()
    bad = [r for r in roles if r not in ROLE_NAMES]
    if bad:
        raise RecipeError(f"{where}: unknown role(s) {bad}; known roles: {list(ROLE_NAMES)}")
    names = _str_list(d["names"], f"{where}.names") if "names" in d else ()
    if not roles and not names:
        raise RecipeError(f"{where}: a rule needs `roles` or `names`")
    scale_rule = str(d.get("scale_rule", "6"))
    importance = d.get("importance", False)
    if not fmt.startswith("nvfp4") and ("scale_rule" in d or "importance" in d):
        raise RecipeError(f"{where}: scale_rule/importance apply to nvfp4 formats only, not {fmt!r}")
    if scale_rule not in ("6", "4o6"):
        raise RecipeError(f"{where}: scale_rule must be '6' or '4o6', got {scale_rule!r}")
    if not isinstance(importance, bool):
        raise RecipeError(f"{where}: importance must be true or false, got {importance!r}")
    if importance and scale_rule != "4o6":
        raise RecipeError(f"{where}: importance weighting needs scale_rule '4o6'")
    search = d.get("amax_search", [])
    if "amax_search" in d and fmt != "fp8":
        raise RecipeError(f"{where}: amax_search applies to the fp8 format only, not {fmt!r}")
    if not isinstance(search, list) or not all(
        isinstance(c, (int, float)) and not isinstance(c, bool) and 0 < c < float("inf") for c in search
    ):
        raise RecipeError(f"{where}: amax_search must be a list of positive numbers (range multipliers), got {search!r}")
    return Rule(format=fmt, roles=roles, names=names, scale_rule=scale_rule, importance=importance,
                amax_search=tuple(float(c) for c in search))


def recipe_from_dict(d, source: str = "<dict>") -> Recipe:
    if not isinstance(d, dict):
        raise RecipeError(f"{source}: a recipe must be a mapping at the top level")
    _check_keys(d, _RECIPE_KEYS, source)
    name = d.get("name")
    if not isinstance(name, str) or not name:
        raise RecipeError(f"{source}: `name` must be a non-empty string")
    version = d.get("version", RECIPE_VERSION)
    if version != RECIPE_VERSION:
        raise RecipeError(f"{source}: recipe version {version!r} is not supported (this fp4kit reads version {RECIPE_VERSION})")
    kv = d.get("kv_cache", "none")
    if kv not in KV_CACHE:
        raise RecipeError(f"{source}: kv_cache must be one of {KV_CACHE}, got {kv!r}")
    rules = d.get("rules")
    if not isinstance(rules, list) or not rules:
        raise RecipeError(f"{source}: `rules` must be a non-empty list")
    parsed = tuple(_parse_rule(r, f"{source}: rules[{i}]") for i, r in enumerate(rules))
    exclude = _str_list(d["exclude"], f"{source}: exclude") if d.get("exclude") else ()
    description = d.get("description", "")
    if not isinstance(description, str):
        raise RecipeError(f"{source}: description must be a string")
    return Recipe(name=name, rules=parsed, version=version, description=description.strip(), kv_cache=kv, exclude=exclude, source=source)


def config_dir() -> Path:
    """The shipped recipes (installed as the package data of `fp4kit.configs`)."""
    return Path(str(importlib.resources.files("fp4kit.configs")))


def available_recipes() -> dict[str, Path]:
    return {p.stem: p for p in sorted(config_dir().glob("*.yaml"))}


def load_recipe(name_or_path: str) -> Recipe:
    """A recipe by registry name (configs/<name>.yaml) or by file path."""
    registry = available_recipes()
    path = registry.get(name_or_path)
    if path is None:
        candidate = Path(name_or_path)
        if candidate.suffix in (".yaml", ".yml") and candidate.is_file():
            path = candidate
        else:
            raise RecipeError(f"unknown recipe {name_or_path!r}: not one of {sorted(registry)} and not a .yaml file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML: {exc}") from None
    return recipe_from_dict(data, source=str(path))
