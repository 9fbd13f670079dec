"""Smoke test of the speed benchmark: ``--quick`` on the demo pair writes its outputs and
every specray config reproduces plain greedy decoding token for token."""

import csv
import json

import pytest
import torch


@pytest.mark.slow
def test_quick_benchmark(tmp_path):
    from specray.bench import speed

    threads = torch.get_num_threads()
    rc = speed.main(["--quick", "--out", str(tmp_path)])
    assert torch.get_num_threads() == threads  # main() restores the thread count

    for name in ("speed.csv", "speed.png", "speed.json", "speed.txt"):
        assert (tmp_path / name).is_file() and (tmp_path / name).stat().st_size > 0, name

    with open(tmp_path / "speed.csv", newline="") as fh:
        rows = {r["config"]: r for r in csv.DictReader(fh)}
    expected = {"specray plain", "specray draft k=1", "specray draft k=2", "specray ngram k=2",
                "hf plain", "hf assisted (default)", "hf prompt-lookup k=2"}
    assert expected <= set(rows)
    for name, row in rows.items():
        assert float(row["tokens_per_s"]) > 0, name
        assert int(row["tokens"]) == 2 * 32, name  # 2 prompts x 32 tokens, EOS ignored
        if row["system"] == "specray":
            assert int(row["mismatch_vs_specray_plain"]) == 0, name
            assert int(row["mismatch_vs_hf_plain"]) == 0, name
    assert rows["specray draft k=2"]["bound"] not in ("", "nan")

    report = json.loads((tmp_path / "speed.json").read_text())
    assert rc == 0
    assert report["total_mismatches"] == 0
    assert report["command"].endswith("--quick --out " + str(tmp_path))
    s = report["summary"]
    assert 0.0 <= s["alpha_teacher_forced"] <= 1.0
    assert 0.0 < s["cost_ratio_c"] < 1.0  # a 1-layer draft is cheaper than the target
    assert {r["config"] for r in report["rows"]} == set(rows)


def test_gpu_benchmark_runs_on_the_cpu(tmp_path):
    """bench.gpu must work in one command on a GPU machine; on the CPU its small synthetic
    shape runs the same code (pair, HF baseline, engines, probes, table, plot)."""
    from specray.bench import gpu

    rc = gpu.main(["--device", "cpu", "--shape", "tiny", "--batch", "1,2", "--max-tokens", "12", "--modes",
                   "eager,static", "--hf", "eager", "--configs", "none,draft k=4", "--profile-steps", "3",
                   "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "gpu.json").read_text())
    rows = {(r["config"], r["mode"], r["batch"]): r for r in report["rows"]}
    assert report["summary"]["pair"].startswith("SYNTHETIC")
    assert rows[("specray none", "static", 2)]["reads"] == 1  # one host read per step
    assert rows[("specray draft k=4", "static", 1)]["reads"] == 1
    assert rows[("specray draft k=4", "eager", 1)]["reads"] > 1  # the eager reference reads per draft token
    assert all(r["agree_rows"] in (None, "1/1", "2/2") for r in report["rows"])  # float32: greedy identical
    assert (tmp_path / "gpu.png").stat().st_size > 0


@pytest.mark.slow
def test_penalties_benchmark(tmp_path):
    from specray.bench import penalties

    rc = penalties.main(["--modes", "eager,static", "--batch", "1", "--prompts", "2", "--max-tokens", "16",
                         "--repeats", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "penalties.json").read_text())["rows"]
    assert rc == 0 and len(rows) == 8 and all(r["mismatches_vs_plain"] == 0 for r in rows)


@pytest.mark.slow
def test_quantization_benchmark(tmp_path):
    from specray.bench import quantization

    rc = quantization.main(["--dtypes", "float32", "--batch", "1", "--prompts", "2", "--max-tokens", "16",
                            "--repeats", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "quantization.json").read_text())
    assert rc == 0 and len(result["decoding"]) == 4 and all(r["mismatches_vs_plain"] == 0 for r in result["decoding"])
    fp8 = [r for r in result["bytes"] if r["quantization"] == "fp8"]
    assert len(fp8) == 2 and all(0.25 <= r["linear_x_float32"] <= 0.27 for r in fp8)


@pytest.mark.slow
def test_selftune_benchmark(tmp_path):
    """bench.selftune runs (the draft model only: no heads to train) and writes its table,
    the mixed batch included, every config's output token-identical to plain decoding (it
    asserts that itself)."""
    from specray.bench import selftune

    selftune.main(["--methods", "draft", "--batches", "2", "--rounds", "1", "--max-tokens", "8", "--queue", "1",
                   "--mixed", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "selftune.json").read_text())["rows"]
    assert [r["method"].split()[0] for r in rows] == ["draft", "mixed"]
    assert set(rows[0]["sweep"]) == {'{"num_speculative_tokens": %d}' % k for k in (1, 2, 4, 8)}
    assert all(r["default"]["median"] > 0 and r["fixed"]["median"] > 0 for r in rows)
    assert (tmp_path / "selftune.png").stat().st_size > 0 and "plain beside plain" in (tmp_path / "selftune.txt").read_text()


@pytest.mark.slow  # the demo pair's weights
def test_structured_benchmark_is_lossless_and_counts_forced_tokens(tmp_path):
    """bench.structured at its smallest: every constrained configuration gives plain constrained
    decoding's tokens (it raises otherwise), and the grammar drafter drafts forced tokens and
    saves target forwards."""
    from specray.bench import structured

    structured.main(["--batches", "1", "--prompts-per-row", "1", "--rounds", "1", "--max-tokens", "24",
                     "--methods", "ngram", "--out", str(tmp_path)])
    for name in ("structured.csv", "structured.png", "structured.json", "structured.txt"):
        assert (tmp_path / name).stat().st_size > 0, name
    rows = {r["config"]: r for r in json.loads((tmp_path / "structured.json").read_text())["rows"]}
    assert set(rows) == {"plain, free", "plain", "plain + grammar", "ngram", "ngram + grammar"}
    on, off = rows["plain + grammar"], rows["plain"]
    assert on["tokens"] == off["tokens"] and 0 < on["forced_accepted"] <= on["forced_tokens"]
    assert on["forwards"] < off["forwards"]
