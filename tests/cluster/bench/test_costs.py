"""``ralmspec bench costs --scans``: every exact-dense candidate scan measured side by side, at
batch 1 and 16, with their hits checked equal, and the machine line naming the kernels."""

from __future__ import annotations


def test_scan_costs_compare_paths_and_check_their_hits(retrievers, fixture_corpus):
    from cluster.bench.costs import measure_scans, scans_markdown
    from ralm.retrieval import int8_kernels

    kernels = [f"int8:{k}" for k in int8_kernels.exact_kernels(retrievers["edr"].scorer.dim)]
    scans = ["faiss", "int8", *kernels, "int8-own-widths", "bf16", "auto"]
    res = measure_scans(retrievers["edr"], fixture_corpus, scans, pad_to=20_000, reps=2, sizes=(1, 3, 16))
    assert list(res) == scans
    assert res["int8"]["path"] == res[kernels[0]]["path"]  # the first exact kernel
    for k in kernels:
        assert res[k]["path"].startswith("int8 +-") and res[k]["path"].endswith(k.split(":")[1])
    assert res["int8-own-widths"]["path"] == res["int8:int_mm"]["path"] + " own widths"
    assert res["auto"]["path"] in [res[k]["path"] for k in kernels] + ["bf16"]  # 20k rows: untimed
    for scan, r in res.items():
        assert scan == "auto" or r["path"].split()[0] == scan.split("-")[0].split(":")[0]
        assert r["rows"] == 20_000
        assert r["batch1_ms"] > 0 and r["batch3_ms"] > 0 and r["batch16_ms"] > 0
        assert r["ratio_last_to_first"] == r["batch16_ms"] / r["batch1_ms"]
        assert r["same_hits_as_first"] is True  # padded or not, every scan finds the same hits
    md = scans_markdown({"reps": 2, "pad_to": 20_000, "sizes": [1, 3, 16], "scans": res})
    assert md.startswith("Machine: ") and "torch kernels" in md and "bf16 instructions" in md
    assert "| batch 1 ms | batch 3 ms | batch 16 ms | 16 vs 1 |" in md
    assert md.count("| yes |") == len(scans) and f"| auto ({res['auto']['path']}) |" in md


def test_the_machine_line_names_an_isa_cap(monkeypatch):
    from cluster.report import machine_note

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    line = machine_note({"edr": "int8"})
    assert "bf16 instructions no" in line and "capped: ONEDNN_MAX_CPU_ISA=AVX2" in line
    assert line.endswith("candidate scan: edr int8")
