"""Config fields at the ground floor: declared once (:mod:`goat_jax.config.fields`), imported
by models, data pipelines, tasks and the engine alike (it imports nothing from goat_jax)."""

from goat_jax.config.fields import (FLOAT32_MAX, Bool, Dtype, Field, Float, Floats, Int, Ints, Section, Str, Strs,
                                    borrow, check_config, check_instance, check_section, declare,
                                    specs_of)

__all__ = ["FLOAT32_MAX", "Bool", "Dtype", "Field", "Float", "Floats", "Int", "Ints", "Section", "Str", "Strs", "borrow",
           "check_config", "check_instance", "check_section", "declare", "specs_of"]
