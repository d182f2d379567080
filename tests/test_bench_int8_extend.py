"""bench/int8_extend.py in a small run: the report's shape and the errors, which do not depend on noise."""

from __future__ import annotations

import json


def test_int8_extend_report(tmp_path, default_model_path) -> None:
    from bench.int8_extend import PATHS, main

    out = tmp_path / "int8_extend.json"
    report = main(["--quick", "--dtypes", "float32", "--rows", "32", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    # The default model: 30 layers of q/k/v, o, gate/up and down.
    assert report["layers"] == 30
    assert [s[0] for s in report["shapes"]] == ["qkv", "o", "gate_up", "down"]
    rows = {r["path"]: r for r in report["results"]}
    assert set(rows) == set(PATHS)
    # The served path multiplies the 4-bit weights' own values: float32 rounding only.  The int8
    # path quantizes both sides: an error of about a percent, never zero.
    assert rows["served"]["relative_error"] < 1e-5
    assert 1e-3 < rows["int8-dynamic"]["relative_error"] < 0.05
    assert rows["served"]["ratio_vs_served"] == 1.0 and rows["int8-dynamic"]["step_ms"] > 0
