"""bench/cache_views.py in its quick mode: the report's shape, the summary's size, and that the
poller really polled while the streams ran."""

from __future__ import annotations

import json


def test_quick_cache_views_report(tmp_path, default_model_path) -> None:
    from bench.cache_views import main

    out = tmp_path / "cache_views.json"
    report = main(["--quick", "--dtype", "float32", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    p = report["params"]
    for row in report["summary"]:
        assert row["tokens"] == p["systems"] * p["system_len"] + p["convs"] * p["conv_len"]
        assert row["nodes"] == p["systems"] + p["convs"] * p["turns"] and row["median_ms"] > 0
    runs = report["load"]
    assert [r["poller"] for r in runs] == [False, True, False, True]
    assert all(r["steps"] > 0 for r in runs)
    assert all(r["polls"] > 0 for r in runs if r["poller"]) and all(r["polls"] == 0 for r in runs if not r["poller"])
    assert {t["target"] for t in report["targets"]} == {"summary (limit 50, the default), ms <=",
                                                       "step time change with the poller <="}
