"""The shipped tolerance presets against the rules scripts/calibrate_tolerances.py applies when it writes them."""
from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRESETS = sorted((REPO / "fixtures" / "tolerances").glob("*.json"))

spec = importlib.util.spec_from_file_location("calibrate_tolerances", REPO / "scripts" / "calibrate_tolerances.py")
cal = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cal)


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_a_normalization_is_never_bounded_tighter_than_its_input(path):
    if path.stem.endswith("_local"):
        pytest.skip("a _local preset bounds each op on the reference's inputs: no error is carried in")
    preset = json.loads(path.read_text())
    rules = preset["rules"]
    floored = copy.deepcopy(rules)
    cal.floor_normalized(floored, preset["default"])
    assert [r["match"] for r in floored] == [r["match"] for r in rules], (
        f"{path.name}: a normalization falls to the default, tighter than its input's rule: "
        f"{sorted(set(r['match'] for r in floored) - set(r['match'] for r in rules))}")
    for before, after in zip(rules, floored):
        assert {k: v for k, v in before.items() if k != "reason"} == {k: v for k, v in after.items() if k != "reason"}, (
            f"{path.name}: {before['match']} is tighter than {cal.NORMALIZES[before['match'].split('-')[0]]}'s rule")


def test_floor_raises_layer_patterns_separately():
    rules = [{"match": "Qcur-0", "max_rel_l2": 2.5e-4, "max_row_rel_l2": 1e-3},
             {"match": "Qcur-*", "max_rel_l2": 9.4e-3},
             {"match": "Qnorm-0", "max_rel_l2": 2e-5},
             {"match": "Qnorm-*", "max_rel_l2": 1.4e-3, "max_row_rel_l2": 1e-4},
             {"match": "Knorm-*", "max_rel_l2": 1e-3}]
    cal.floor_normalized(rules)
    by = {r["match"]: r for r in rules}
    assert by["Qnorm-0"]["max_rel_l2"] == 2.5e-4 and "max_row_rel_l2" not in by["Qnorm-0"]
    assert by["Qnorm-*"]["max_rel_l2"] == 9.4e-3 and by["Qnorm-*"]["max_row_rel_l2"] == 1e-4
    assert by["Knorm-*"]["max_rel_l2"] == 1e-3  # no Kcur rule: unchanged
    assert "raised to Qcur-0's bounds" in by["Qnorm-0"]["reason"]


def test_a_normalization_without_a_rule_gets_its_inputs_bounds_over_a_tighter_default():
    default = {"max_rel_l2": 2e-5, "max_row_rel_l2": 5e-5}
    rules = [{"match": "ffn_out-0", "max_rel_l2": 1e-5, "max_row_rel_l2": 4e-5},  # tighter than the default
             {"match": "ffn_out-*", "max_rel_l2": 1.5e-4, "max_row_rel_l2": 2.5e-4},
             {"match": "attn_out-*", "max_rel_l2": 8.8e-5},
             {"match": "Qcur-*", "max_rel_l2": 1e-3},
             {"match": "Qnorm-*", "max_rel_l2": 1e-3}]
    cal.floor_normalized(rules, default)
    by = {r["match"]: r for r in rules}
    assert [r["match"] for r in rules] == ["ffn_out-0", "ffn_out-*", "ffn_post_norm-*", "attn_out-*",
                                          "attn_post_norm-*", "Qcur-*", "Qnorm-*"]
    assert by["ffn_post_norm-*"]["max_rel_l2"] == 1.5e-4 and by["ffn_post_norm-*"]["max_row_rel_l2"] == 2.5e-4
    # the input bounds no rows: the default's row bound stays
    assert by["attn_post_norm-*"]["max_rel_l2"] == 8.8e-5 and by["attn_post_norm-*"]["max_row_rel_l2"] == 5e-5
    assert "raised to ffn_out-*'s bounds" in by["ffn_post_norm-*"]["reason"]
    cal.floor_normalized(rules)  # no default given: only the rules there are raised
    assert len(rules) == 7


def test_regenerating_a_preset_keeps_the_keys_calibration_does_not_measure(tmp_path):
    old = tmp_path / "p.json"
    old.write_text(json.dumps({"rules": [{"match": "Qrope-0", "max_rel_l2": 1e-5, "rel_l2_per_position": 2e-8},
                                         {"match": "Krope-*", "max_rel_l2": 1e-5}]}))
    rules = [{"match": "Qrope-0", "max_rel_l2": 3e-5}, {"match": "Krope-*", "max_rel_l2": 4e-5}]
    cal.carry_over(rules, old)
    assert rules[0] == {"match": "Qrope-0", "max_rel_l2": 3e-5, "rel_l2_per_position": 2e-8}
    assert rules[1] == {"match": "Krope-*", "max_rel_l2": 4e-5}
    cal.carry_over(rules, tmp_path / "absent.json")  # nothing to carry from
