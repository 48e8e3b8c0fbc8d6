"""Recipes shipped with fp4kit (YAML files beside this one), installed as `fp4kit.configs`."""
