"""The plan's gate block (optimize/plan.py GateSettings): GateConfig's keys with their types and defaults,
built and checked once when the plan is made, frozen, read by attribute; a key the gate does not have or
a value not of its type is one RecipeError naming the key."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from optimize.config import GateConfig
from optimize.errors import RecipeError
from optimize.plan import GateSettings

REPO = Path(__file__).resolve().parents[2]


def test_the_gate_block_mirrors_the_schema_key_for_key_with_its_defaults():
    schema = {f.name: f.default for f in dataclasses.fields(GateConfig)}
    block = {f.name: f.default for f in dataclasses.fields(GateSettings)}
    assert list(block) == list(schema)
    assert block == schema


def test_each_key_takes_the_types_the_schema_gives_it():
    schema = typing.get_type_hints(GateConfig)
    block = typing.get_type_hints(GateSettings)
    for key, hint in schema.items():
        if hint is typing.Any:  # the selectors: a number or `all`, checked where they are read
            assert str in typing.get_args(block[key]) and int in typing.get_args(block[key]), key
        else:
            assert set(typing.get_args(hint) or (hint,)) == set(typing.get_args(block[key]) or (block[key],)), key


def test_a_recipe_section_becomes_the_typed_frozen_block():
    section = OmegaConf.structured(GateConfig(min_cosine=0.99, speedup_batch_size="all", served_prompt_tokens=64))
    gate = GateSettings.of(section)
    assert (gate.min_cosine, gate.speedup_batch_size, gate.served_prompt_tokens) == (0.99, "all", 64)
    assert gate.max_p95_ms is None and gate.served_requests_per_client == 2
    assert dict(gate) == OmegaConf.to_container(section)  # the mapping gate.judge reads
    assert GateSettings.of(gate) is gate
    with pytest.raises(dataclasses.FrozenInstanceError):
        gate.min_cosine = 0.5  # type: ignore[misc]


def test_a_whole_number_is_a_float_threshold():
    gate = GateSettings.of({"min_speedup": 2})
    assert gate.min_speedup == 2.0 and isinstance(gate.min_speedup, float)


@pytest.mark.parametrize(
    "section, message",
    [
        ({"min_cosin": 0.99}, r"^gate\.min_cosin: no such key in the gate"),
        ({"min_cosine": "high"}, r"^gate\.min_cosine='high': give a number or null$"),
        ({"min_cosine": True}, r"^gate\.min_cosine=True: give a number or null$"),
        ({"served_prompt_tokens": 6.5}, r"^gate\.served_prompt_tokens=6\.5: give a whole number or null$"),
        ({"served_requests_per_client": None}, r"^gate\.served_requests_per_client=None: give a whole number$"),
        ({"speedup_batch_size": [1, 2]}, r"^gate\.speedup_batch_size=\[1, 2\]: give a whole number or a word"),
    ],
)
def test_a_key_or_value_the_gate_does_not_take_is_one_line_naming_it(section, message):
    with pytest.raises(RecipeError, match=message) as refused:
        GateSettings.of(OmegaConf.create(section))
    assert "\n" not in str(refused.value)


def test_no_module_reads_the_plans_gate_by_a_key_string():
    reads = re.compile(r"""\.plan\.gate(\[|\.get\()["']|\bplan\.gate(\[|\.get\()["']""")
    found = [
        f"{path.relative_to(REPO)}:{n}"
        for path in sorted((REPO / "optimize").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if reads.search(line)
    ]
    assert found == []
