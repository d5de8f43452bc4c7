"""The per-layer table: plain-dict rows, a DataFrame, and torchinfo as the oracle for shapes and counts."""

from __future__ import annotations

import json

import pytest


from .cases import CASES
from .conftest import measured

CASE = {c.name: c for c in CASES}
ROW_KEYS = {
    "name",
    "type_name",
    "depth",
    "output_shape",
    "trainable_params",
    "frozen_params",
    "saved_bytes_own",
    "saved_bytes",
    "calls",
    "is_leaf",
    "share",
    "output_bytes_own",
    "output_bytes",
    "trainable_params_subtree",
    "frozen_params_subtree",
}


def test_rows_are_plain_dicts(case):
    m = measured(case)
    rows = m.rows()
    assert len(rows) == len(m.modules)
    for row, mod in zip(rows, m.modules):
        assert type(row) is dict and set(row) == ROW_KEYS
        assert row["name"] == mod.name and row["saved_bytes"] == mod.saved_bytes
        assert 0.0 <= row["share"] <= 1.0
    assert rows[0]["name"] == "" and rows[0]["share"] == (1.0 if m.saved_bytes else 0.0)
    json.dumps(rows)  # nothing but plain values


def test_dataframe():
    pd = pytest.importorskip("pandas")
    m = measured(CASE["zoo_cnn"])
    df = m.to_dataframe()
    assert isinstance(df, pd.DataFrame)
    assert list(df["name"]) == [r.name for r in m.modules]
    assert df["saved_bytes_own"].sum() == m.saved_bytes
    assert df.loc[df["name"] == "", "saved_bytes"].item() == m.saved_bytes


@pytest.mark.parametrize("name", ["zoo_cnn", "inplace_relu", "frozen_cnn", "reused", "views"])
def test_shapes_and_params_agree_with_torchinfo(name):
    torchinfo = pytest.importorskip("torchinfo")
    case = CASE[name]
    wl = case.build()
    m = measured(case)
    info = torchinfo.summary(wl.model, input_data=[wl.make_batch()], verbose=0, depth=100)
    names = {id(mod): n for n, mod in wl.model.named_modules()}
    own = {r.name: r.params for r in m.modules}
    seen = set()
    for layer in info.summary_list:
        module_name = names[id(layer.module)]
        if module_name in seen:  # torchinfo lists a reused module once per call
            continue
        seen.add(module_name)
        row = m.module(module_name)
        subtree = sum(
            p for n, p in own.items() if n == module_name or module_name == "" or n.startswith(module_name + ".")
        )
        assert layer.num_params == subtree, module_name
        if layer.output_size:  # containers that are never called (ModuleList) have none
            assert list(row.output_shape) == list(layer.output_size), module_name
        assert row.type_name == layer.class_name
    assert seen == {r.name for r in m.modules if r.calls} | {
        r.name for r in m.modules if not r.calls and r.name in seen
    }
