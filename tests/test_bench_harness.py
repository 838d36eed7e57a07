"""The benchmark harness produces its schema (frame, ratio table, JSON, Markdown). No timing is asserted here."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("curvlab_bench_harness", BENCH / "harness.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SIZES = [{"n": 8}, {"n": 16}]
VARIANTS = {"ones": lambda n: torch.ones(n, 1000).sum(), "zeros": lambda n: torch.zeros(n).sum()}


def test_bench_harness_compare_schema_and_reports(harness, tmp_path):
    frame = harness.compare("toy", VARIANTS, SIZES, repeats=5, warmup=1, device="cpu", results_dir=tmp_path,
                            threads=(1, "default"), fixed={"dtype": "float32"})
    assert set(harness.RESERVED) | {"n"} <= set(frame.columns)
    nthreads = 1 + (harness.default_threads() != 1)
    assert len(frame) == len(SIZES) * len(VARIANTS) * 5 * 2
    assert frame["threads"].nunique() == nthreads and 1 in set(frame["threads"])      # protocol 1: both settings
    per_repeat = frame.groupby(["size", "threads", "repeat"])["variant"].apply(set)
    assert all(v == set(VARIANTS) for v in per_repeat)  # alternated: every repeat runs every variant
    first = frame[frame["order"] == 0].groupby(["size", "threads"])["variant"].nunique()
    assert (first == 2).all()  # the order rotates between repeats
    assert (frame["time_s"] > 0).all() and frame["mem_method"].str.len().gt(0).all()
    if frame["mem_method"].iloc[0].startswith("torch.profiler"):
        ones = frame[(frame["variant"] == "ones") & (frame["n"] == 16)]
        assert (ones["peak_mem_bytes"] >= 16 * 1000 * 4).all()  # the method sees torch's CPU allocations

    ratios = harness.ratio_table(frame)
    want = {"size", "threads", "variant", "baseline", "median_time_s", "min_time_s", "ratio", "ratio_q25",
            "ratio_q75", "ratio_ci_low", "ratio_ci_high", "ratio_ci_coverage", "peak_mem_bytes", "mem_ratio"}
    assert want <= set(ratios.columns) and len(ratios) == 4 * 2
    assert (ratios.loc[ratios["variant"] == "ones", "ratio"] == 1.0).all()  # default baseline: first variant
    assert (ratios["ratio_ci_coverage"] >= harness.INTERVAL_COVERAGE).all()

    md = (tmp_path / "toy.md").read_text()
    assert "| size | threads | variant | median time (ms) | time ratio |" in md and "`ones`" in md
    assert md.count("\n| n=") == 8 and "Peak memory:" in md and "Machine:" in md
    assert "Sizes: n = 8; n = 16; fixed: dtype = float32." in md and "load average" in md and "before" in md
    payload = json.loads((tmp_path / "toy.json").read_text())
    assert {"name", "protocol", "machine", "settings", "runs", "flagged", "exercised_code", "ratios",
            "records"} <= set(payload)
    assert {"cpu_model", "logical_cores", "torch", "numpy", "device", "revision", "dirty", "revision_label",
            "curvlab_path"} <= set(payload["machine"])
    assert len(payload["records"]) == len(frame) and payload["settings"]["baseline"] == "ones"
    assert payload["protocol"]["min_repeats"] == harness.MIN_REPEATS
    assert [r["threads"] for r in payload["runs"]][0] == 1
    assert all({"load_before", "load_after", "flagged"} <= set(r) for r in payload["runs"])
    # the traced code: this test's lambdas live outside lib/ and benchmarks/, the harness itself inside
    assert all(k.startswith(("lib/", "benchmarks/")) for k in payload["exercised_code"])
    assert all(len(h) == 64 for h in payload["exercised_code"].values())


def test_bench_harness_protocol_refuses_few_repeats_and_intervals_of_few_values(harness):
    with pytest.raises(ValueError, match="repeats must be >= 5"):
        harness.compare("toy", VARIANTS, SIZES, repeats=3, write=False)
    frame = harness.compare("toy", VARIANTS, SIZES[:1], repeats=3, write=False, allow_few_repeats=True,
                            threads=(1,), memory=False, trace=False)
    assert frame.attrs["settings"]["protocol_ok"] is False
    assert harness.ratio_table(frame)["ratio_ci_low"].isna().all()  # no interval from 3 values
    lo, hi, cov = harness.median_interval([1.0, 2.0, 3.0])
    assert all(x != x for x in (lo, hi, cov))
    lo, hi, cov = harness.median_interval([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (lo, hi) == (1.0, 5.0) and cov == pytest.approx(1 - 2 / 32)        # [x_(1), x_(5)]: 93.75 %
    lo, hi, cov = harness.median_interval(list(range(1, 10)))
    assert (lo, hi) == (2.0, 8.0) and cov == pytest.approx(1 - 2 * 10 / 512)    # n = 9: [x_(2), x_(8)]
    with pytest.raises(ValueError, match="threads"):
        harness.compare("toy", VARIANTS, SIZES, threads=(0,), write=False)


def test_bench_harness_load_flag_rule(harness):
    limit = harness.LOAD_LIMIT_PER_CORE * 2
    assert not harness.load_flag(0.2, 1.2, threads=1, cores=2)                  # own thread only
    assert harness.load_flag(limit + 0.1, 0.5, threads=1, cores=2)              # busy before
    assert harness.load_flag(0.2, limit + 1.2, threads=1, cores=2)              # others joined during the run
    assert not harness.load_flag(None, None, threads=1, cores=2)


def test_bench_harness_traces_the_library_code_a_call_runs(harness):
    from curvlab import config

    files = harness.trace_code(lambda: config.pick(1, 2, profile_name="quick"))
    assert "lib/curvlab/config.py" in files and all(f.startswith(("lib/", "benchmarks/")) for f in files)
    hashes = harness.code_hashes(sorted(files))
    assert set(hashes) == files


def test_bench_harness_setup_runs_once_per_size(harness, tmp_path):
    calls = []

    def setup(n):
        calls.append(n)
        return torch.arange(float(n))

    variants = {"sum": lambda x: x.sum(), "cumsum": lambda x: x.cumsum(0)}
    frame = harness.compare("toy_setup", variants, SIZES, setup=setup, repeats=5, warmup=0, baseline="cumsum",
                            device="cpu", memory=False, write=False, results_dir=tmp_path, threads=(1, 1))
    assert calls == [8, 16]  # once per size, shared by the thread settings and not (tmp_path / "toy_setup.md").exists()
    assert harness.ratio_table(frame).query("variant == 'cumsum'")["ratio"].eq(1.0).all()
    assert frame["mem_method"].eq("not measured").all()


def test_bench_harness_min_time_repeats_short_calls_back_to_back(harness, tmp_path):
    import time

    counts = {"fast": 0, "slow": 0}

    def fast(n):
        counts["fast"] += 1

    def slow(n):
        counts["slow"] += 1
        time.sleep(0.03)

    frame = harness.compare("toy_min_time", {"slow": slow, "fast": fast}, [{"n": 1}], repeats=2, warmup=1,
                            device="cpu", memory=False, write=False, results_dir=tmp_path, min_time=0.02,
                            threads=(1,), allow_few_repeats=True, trace=False)
    per = frame.groupby("variant").calls_per_timing.first()
    assert per["slow"] == 1 and per["fast"] > 100                       # a ~us call is repeated, a 30 ms one is not
    assert counts["slow"] == 1 + 2 and counts["fast"] == 1 + 2 * per["fast"]
    assert frame.query("variant == 'fast'").time_s.max() < 1e-3          # recorded per call
    with pytest.raises(ValueError, match="min_time"):
        harness.compare("toy", {"slow": slow}, [{"n": 1}], warmup=0, min_time=0.01, write=False)


def test_bench_harness_bad_arguments(harness):
    with pytest.raises(ValueError, match="baseline"):
        harness.compare("toy", VARIANTS, SIZES, baseline="nope", write=False)
    with pytest.raises(ValueError, match="name"):
        harness.compare("bad name", VARIANTS, SIZES, write=False)
    with pytest.raises(TypeError, match="variants"):
        harness.compare("toy", {}, SIZES, write=False)
    with pytest.raises(ValueError, match="sizes"):
        harness.compare("toy", VARIANTS, [{"time_s": 1}], write=False)


def test_fit_exponent_recovers_a_known_power_and_the_rule_excludes_overhead(harness, tmp_path):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    x = np.geomspace(100, 10_000, 6)
    samples = [1e-9 * xv ** 2 * np.exp(rng.normal(0, 0.02, 7)) for xv in x]
    fit = harness.fit_exponent(x, samples)
    assert fit["ci_low"] <= 2.0 <= fit["ci_high"] and abs(fit["exponent"] - 2) < 0.05
    assert fit["ci_low"] <= fit["boot_low"] and fit["ci_high"] >= fit["t_high"]
    with pytest.raises(ValueError, match="sizes"):
        harness.fit_exponent([1, 2], [[1.0], [2.0]])
    # a frame as compare() makes it: the probe, two overhead-dominated sizes, then six asymptotic ones
    rows = [{"benchmark": "toy", "variant": "v", "size": "n=1", "n": 1, "time_s": 1e-4, "repeat": k} for k in range(3)]
    for n in [2, 5, *np.geomspace(100, 1000, 6)]:
        t = max(1e-3, 1e-6 * n ** 2)
        rows += [{"benchmark": "toy", "variant": "v", "size": f"n={n}", "n": n, "time_s": t * (1 + 0.01 * k),
                  "repeat": k} for k in range(3)]
    points, fits = harness.scaling_table(pd.DataFrame(rows), x="n", expected={"v": 2.0}, probe="n=1")
    assert points.loc[points["n"] < 10, "kept"].eq(False).all() and points.loc[points["n"] >= 100, "kept"].sum() >= 5
    (f,) = fits.itertuples()
    assert f.valid and f.verdict == "consistent" and f.decades >= 1.0


def test_scaling_writes_its_reports(harness, tmp_path):
    fits = harness.scaling("toy_scaling", {"fill": lambda n: torch.ones(n, 64).sum()},
                           [{"n": n} for n in (1000, 2000, 4000)], x="n", probe={"n": 1}, expected={"fill": 1.0},
                           repeats=2, warmup=0, device="cpu", results_dir=tmp_path, model="toy.",
                           allow_few_repeats=True)
    assert list(fits["variant"]) == ["fill"]
    md = (tmp_path / "toy_scaling.md").read_text()
    assert "fitted exponent" in md and "Machine:" in md and "probe size `n=1`" in md
    payload = json.loads((tmp_path / "toy_scaling.json").read_text())
    assert payload["kind"] == "scaling" and payload["overhead_factor"] == harness.OVERHEAD_FACTOR
    assert (tmp_path / "toy_scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="x must"):
        harness.scaling("toy_scaling", {"fill": lambda n: 0}, [{"n": 1}], x="m", probe={"n": 1}, expected={},
                        write=False)


# ------------------------------------------------------------------------------------- the mean-field step's model
@pytest.fixture(scope="module")
def mf_bench():
    import sys
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("curvlab_bench_meanfield", BENCH / "bench_meanfield_gn.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_meanfield_roofline_model_prices_each_phase_at_its_bound(mf_bench):
    """The roofline is a lower bound: every phase (the LAPACK ones by their leading flops too) at max(flops / peak
    rate, bytes / peak bandwidth), summed; the phase counts add up to the route totals. Nothing is timed."""
    n, m, d = 500, 2000, 10
    ceil = {"gemm": 1e11, "gemm64": 5e10, "bandwidth": 1e10}
    for route in ("structured", "chunked_dense", "authors_gn"):
        fm = mf_bench.flop_byte_model(route, n, m, d, 8)
        assert fm["flops"] == pytest.approx(sum(f for _, f, _, _ in fm["phases"]))
        assert fm["bytes"] == pytest.approx(sum(b for _, _, b, _ in fm["phases"]))
        assert all(r in ("gemm", "gemm64") for *_, r in fm["phases"])            # no phase priced by its own time
        want = sum(max(f / ceil[r], b / ceil["bandwidth"]) for _, f, b, r in fm["phases"])
        assert mf_bench.roofline_time(fm["phases"], ceil) == pytest.approx(want)
    fa = mf_bench.flop_byte_model("authors_gn", n, m, d, 8)
    svd = next(p for p in fa["phases"] if p[0] == "SVD of K")
    assert svd[1] == pytest.approx(8 / 3 * n ** 3)                               # bidiagonal reduction, from below
    s = mf_bench.flop_byte_model("structured", n, m, d, 8)
    eig = next(p for p in s["phases"] if p[0] == "eigenvalues of K")
    assert eig[1] == pytest.approx(4 / 3 * n ** 3)
    dense = mf_bench.flop_byte_model("chunked_dense", n, m, d, 8)
    grams = next(p for p in s["phases"] if p[0] == "Gram products")
    assert grams[1] == 4 * n * n * m                                   # compute-bound at these ceilings
    vjps = next(p for p in dense["phases"] if p[0].startswith("n VJPs"))
    assert vjps[2] / ceil["bandwidth"] > vjps[1] / ceil["gemm"]        # memory-bound: the (n, n, m) intermediates
    faster = dict(ceil, bandwidth=1e12)                                 # the model responds to its ceilings
    assert mf_bench.roofline_time(dense["phases"], faster) < mf_bench.roofline_time(dense["phases"], ceil)


def test_meanfield_model_report(mf_bench, tmp_path):
    """summarise() and write_model_report() on a synthetic ratio table: efficiency = bound / measured time per
    thread setting, and the report says so (and flags a row above 100 %)."""
    import pandas as pd
    size = "n=500, d=10, m=2000"
    table = pd.DataFrame([
        {"size": size, "dtype": "float64", "threads": 1, "variant": "chunked_dense", "ratio": 1.0,
         "ratio_ci_low": 1.0, "ratio_ci_high": 1.0, "ratio_ci_coverage": 0.9375, "median_time_s": 2.0,
         "mem_ratio": 1.0},
        {"size": size, "dtype": "float64", "threads": 1, "variant": "structured", "ratio": 0.02,
         "ratio_ci_low": 0.019, "ratio_ci_high": 0.021, "ratio_ci_coverage": 0.9375, "median_time_s": 0.04,
         "mem_ratio": 0.1},
    ])
    ceil = {1: {"threads": 1, "gemm": 1e11, "gemm64": 5e10, "bandwidth": 1e10, "fresh_copy": 5e9}}
    out = mf_bench.summarise(table, "chunked_dense", ceil)
    row = out.iloc[0]
    assert row.speedup_measured == pytest.approx(50.0) and row.threads == 1
    assert row.efficiency_structured == pytest.approx(row.roofline_structured_ms / 40.0)
    path = mf_bench.write_model_report([out], {("float64", 1): ceil[1]}, results_dir=tmp_path)
    text = (tmp_path / "meanfield_gn_step_model.md").read_text()
    assert "| efficiency, structured |" in text and f"{100 * row.efficiency_structured:.0f} %" in text
    payload = json.loads(path.read_text())
    assert payload["rows"][0]["baseline"] == "chunked_dense" and "speedup chunked_dense m=2000 float64 threads=1" \
        in payload["figures"]


def test_meanfield_authors_route_chunks_where_its_memory_does_not_fit(mf_bench, monkeypatch):
    """The authors' route holds (n / pieces, n, m) vmapped intermediates. The benchmark's guard turns a chunk that
    would not fit in 60 % of the available memory into the exception their doubling rule catches, so the route
    chunks instead of being skipped; its direction is unchanged (no large allocation here: a tiny problem and a
    stubbed memory size)."""
    s = mf_bench.problem(40, 3, 30)
    ref = mf_bench.structured(s)
    free = mf_bench._available_bytes
    # room for a quarter of the rows at a time: 3 * 8 * 10 * 40 * 30 bytes / 0.6
    monkeypatch.setattr(mf_bench, "_available_bytes", lambda: 3 * 8 * 10 * 40 * 30 / 0.6 + 1)
    got = mf_bench.authors_gn_route(s)
    assert s["authors_opt"].pieces == 4
    assert torch.allclose(got, ref, rtol=1e-8, atol=1e-10 * float(ref.abs().max()))
    monkeypatch.setattr(mf_bench, "_available_bytes", free)


def test_gn_conditioning_general_case_routes_agree_and_model_counts():
    """The general-case benchmark (anisotropic inputs, L = 3 and 4): the dense and reduced routes give the same kappa,
    and the flop model's bound is dominated by the two eigensolvers (p^3 against (d_y d)^3). Nothing is timed."""
    import sys
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("curvlab_bench_gnc", BENCH / "bench_gn_conditioning.py")
    b = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(b)
    for L, m in ((3, 8), (4, 7)):
        s = b.problem_general(6, 3, L, m)
        assert abs(b.kappa_dense_general(s) / b.kappa_reduced_general(s) - 1) < 1e-9
    p, D = 64 * 37 + 37 * 37 + 37 * 10, 640
    fd, fr = b.general_flops("dense", 64, 10, 3, 37, 128), b.general_flops("reduced", 64, 10, 3, 37, 128)
    assert fd > 4 / 3 * p**3 and fr > 4 / 3 * D**3
    assert 100 < fd / fr < 1000        # the physical bound at d_y d = 640 is a few hundred, not 1000


# ------------------------------------------------------------------------------------- the performance page (issue 24)
ROOT = BENCH.parent
PAGE = ROOT / "book" / "performance.md"


@pytest.fixture(scope="module")
def bench_ext():
    spec = importlib.util.spec_from_file_location("curvlab_bench_ext", ROOT / "book" / "_ext" / "curvlab_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _clean_payload(**extra):
    return {"name": "x", "protocol": {"min_repeats": 5}, "machine": {"dirty": False, "revision_label": "abc1234",
            "uncommitted_changes": [], "curvlab_from_checkout": True}, "figures": {"f": {"value": 2.0, "text": "2×"}},
            "exercised_code": {}, **extra}


def test_performance_page_refuses_missing_dirty_and_preprotocol_results(bench_ext, tmp_path):
    text = "A {bench}`x::f` speed-up.\n\n```{include} ../benchmarks/results/x.md\n```\n"
    with pytest.raises(bench_ext.BenchPageError, match=r"results/x\.json is missing"):
        bench_ext.process(text, results=tmp_path, root=tmp_path)
    (tmp_path / "x.json").write_text(json.dumps(_clean_payload()))
    out, names = bench_ext.process(text, results=tmp_path, root=tmp_path)
    assert "A 2× speed-up." in out and names == ["x"] and "warning" not in out
    dirty = _clean_payload()
    dirty["machine"].update(dirty=True, revision_label="abc1234+dirty")
    (tmp_path / "x.json").write_text(json.dumps(dirty))
    with pytest.raises(bench_ext.BenchPageError, match=r"x\.json was measured on a dirty"):
        bench_ext.process(text, results=tmp_path, root=tmp_path)
    old = _clean_payload()
    del old["protocol"]
    (tmp_path / "x.json").write_text(json.dumps(old))
    with pytest.raises(bench_ext.BenchPageError, match="predates the benchmark protocol"):
        bench_ext.process(text, results=tmp_path, root=tmp_path)
    (tmp_path / "x.json").write_text(json.dumps(_clean_payload()))
    with pytest.raises(bench_ext.BenchPageError, match="no figure 'g'"):
        bench_ext.process("{bench}`x::g`", results=tmp_path, root=tmp_path)


def test_performance_page_flags_results_whose_library_code_changed(bench_ext, tmp_path):
    import hashlib

    lib = tmp_path / "lib" / "curvlab"
    lib.mkdir(parents=True)
    (lib / "mod.py").write_text("x = 1\n")
    digest = hashlib.sha256(b"x = 1\n").hexdigest()
    payload = _clean_payload(exercised_code={"lib/curvlab/mod.py": digest,
                                             "benchmarks/harness.py": "0" * 64})  # the harness is not measured code
    (tmp_path / "x.json").write_text(json.dumps(payload))
    text = "```{include} ../benchmarks/results/x.md\n```\n"
    out, _ = bench_ext.process(text, results=tmp_path, root=tmp_path)
    assert "warning" not in out
    (lib / "mod.py").write_text("x = 2\n")
    out, _ = bench_ext.process(text, results=tmp_path, root=tmp_path)
    assert ":::{warning}" in out and "`lib/curvlab/mod.py`" in out and "harness" not in out


#: Numbers the page's own prose may type: criteria and protocol constants, not measurements.
ALLOWED_NUMBERS = {
    "100 %",        # an efficiency (bound / measured time) cannot exceed it
    "10 %",         # the acceptance criterion for the baseline's speed against the authors' code
    "1000\\times",  # the kappa routes' design goal
}
MEASURED = re.compile(
    r"(?<![\w.{])(\d[\d,]*(?:\.\d+)?(?:\s*(?:–|-)\s*\d[\d,]*(?:\.\d+)?)?)"
    r"(\s*(?:\\,)?\s*(?:×|\\times|x\b|%|ms\b|s\b|GB/s|GFLOP/s|MiB|GiB|MB\b|times\b|faults\b|page faults))")
SCI = re.compile(r"10\^\{?-?\d+\}?|\d\.\d+e[-+]?\d+")


def _hand_written(text: str) -> str:
    text = re.sub(r"<!-- bench:scaling:start -->.*?<!-- bench:scaling:end -->", "", text, flags=re.S)
    text = re.sub(r"```.*?```", "", text, flags=re.S)                   # includes, figures, code
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"\{bench\}`[^`]+`", "BENCH", text)
    text = re.sub(r"`[^`]*`", "CODE", text)
    return text


def hand_typed_measurements(text: str) -> list[str]:
    body = _hand_written(text)
    found = []
    for mo in MEASURED.finditer(body):
        token = (mo.group(1) + mo.group(2)).strip()
        if token.replace(" ", " ") in ALLOWED_NUMBERS:
            continue
        found.append(token)
    found += [mo.group(0) for mo in SCI.finditer(body)]
    return found


def test_hand_typed_measurement_detector_catches_what_it_must():
    assert hand_typed_measurements("it ran 234× faster, 14.9 s, 76–79 % of it, 3\\times10^{-13}") == \
        ["234×", "14.9 s", "76–79 %", "3\\times", "10^{-13}"]
    assert hand_typed_measurements("with {bench}`x::f` and `python x.py --widths 500,2000` at m = 2000") == []
    assert hand_typed_measurements("```{include} ../benchmarks/results/x.md\n```\n at most 100 % of it") == []


def test_performance_page_every_number_traceable_to_a_committed_clean_results_file(bench_ext):
    """Every figure on the page is a {bench} reference or an include of a committed results file of a clean revision
    under the protocol; the page's prose types no measured number; the generated scaling section is up to date."""
    import subprocess

    text = PAGE.read_text()
    assert hand_typed_measurements(text) == [], "hand-typed measured numbers on book/performance.md"
    _, names = bench_ext.process(text)          # raises on a missing, dirty or pre-protocol file, or a missing figure
    assert names, "the page names no results file"
    tracked = subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode == 0 and tracked.stdout:
        committed = set(tracked.stdout.split())
        missing = [n for n in names if f"benchmarks/results/{n}.json" not in committed]
        assert not missing, f"results files used by the page but not committed: {missing}"
    spec = importlib.util.spec_from_file_location("curvlab_bench_run_all", BENCH / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    block = text.split(run_all.START, 1)[1].split(run_all.END, 1)[0]
    assert block.strip() == run_all.scaling_section().strip(), "rerun benchmarks/run_all.py --page-only"


def test_bench_harness_flags_by_others_cpu_use_not_the_load_average(harness):
    lim = harness.OTHERS_LIMIT_CORES
    # the measured rule wins over a lagging load average in both directions
    assert not harness.load_flag(1.9, 2.1, threads=2, cores=2, others=0.01)
    assert harness.load_flag(0.0, 0.0, threads=1, cores=2, others=lim + 0.05)


@pytest.mark.skipif(not __import__("os").path.exists("/proc/stat"), reason="needs /proc/stat (Linux)")
def test_bench_harness_others_cpu_counts_a_child_as_own_and_a_stranger_as_others(harness):
    import subprocess
    import sys
    import time

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass"
    mark = harness.cpu_mark()
    subprocess.run([sys.executable, "-c", burn], check=True)          # a reaped child: this process's own time
    own = harness.others_cpu(mark)
    mark = harness.cpu_mark()
    stranger = subprocess.Popen([sys.executable, "-c", burn])           # still running at the second mark
    time.sleep(0.5)
    others = harness.others_cpu(mark)
    stranger.wait()
    # the child's 0.6 CPU-s must not be counted; the running stranger must (it burned ~0.4 s in 0.5 s);
    # the margins allow for the rest of a shared machine, which this test cannot control
    assert others is not None and own is not None
    assert others > own + 0.3 or others > 0.5, (own, others)
    synthetic = harness.others_cpu((0.0, 100.0, 10.0), (2.0, 103.0, 11.0))   # 3 busy s, 1 own, over 2 s
    assert synthetic == pytest.approx(1.0)
    assert harness.others_cpu((0.0, None, 0.0), (1.0, 5.0, 0.0)) is None


def test_thread_policy_verdict_is_read_from_the_idle_and_busy_runs(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("curvlab_bench_threads", BENCH / "bench_threads.py")
    bt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bt)
    idle = tmp_path / "thread_chapter.json"
    one = {"threads": 1, "ratio_to_1_thread": 1.0, "ratio_interval": [1.0, 1.0]}

    def busy(r, lo):
        return [one, {"threads": 2, "ratio_to_1_thread": r, "ratio_interval": [lo, r + 1]}]

    assert bt.policy_verdict(busy(3.0, 2.0), idle)["value"] is None               # no idle run: undecided
    idle.write_text(json.dumps({"summary": [one, {"threads": 2, "ratio_to_1_thread": 0.95}]}))
    assert bt.policy_verdict(busy(3.0, 2.0), idle)["value"] == 1.0                # slower when busy: stands
    assert bt.policy_verdict(busy(1.0, 0.9), idle)["value"] == 0.0                # no difference when busy
    idle.write_text(json.dumps({"summary": [one, {"threads": 2, "ratio_to_1_thread": 0.6}]}))
    assert bt.policy_verdict(busy(3.0, 2.0), idle)["value"] == 0.0                # one thread much slower idle


@pytest.mark.skipif(not __import__("os").path.exists("/proc/stat"), reason="needs /proc (Linux)")
def test_bench_harness_kills_what_a_timed_out_command_started_and_counts_its_cpu(harness, tmp_path):
    """As nbconvert does with its kernel: the command starts a CPU-bound grandchild in a session of its own."""
    import os
    import sys
    import time

    pidfile = tmp_path / "grandchild.pid"
    spin = "while True: pass"
    parent = (f"import subprocess, sys, time\np = subprocess.Popen([sys.executable, '-c', {spin!r}], "
              f"start_new_session=True)\nopen({str(pidfile)!r}, 'w').write(str(p.pid))\ntime.sleep(60)")
    code, _, lost = harness.run_to_completion([sys.executable, "-c", parent], timeout=2.0)
    assert code is None and lost > 0.5                       # the grandchild's CPU time is returned
    pid = int(pidfile.read_text())
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)                                      # and it no longer runs
    code, err, lost = harness.run_to_completion([sys.executable, "-c", "import sys; sys.exit(3)"], timeout=30)
    assert (code, lost) == (3, 0.0)


def test_running_page_chapter_times_come_from_a_committed_clean_results_file(bench_ext):
    """The running page's per-chapter times (and the figures in its profile table) are the committed measurement."""
    page = ROOT / "book" / "running.md"
    assert "book/running" in bench_ext.PAGE_DOCNAMES
    text, names = bench_ext.process(page.read_text())     # raises on a missing, dirty or pre-protocol file
    assert names == ["chapter_times_standard"] and "{bench}" not in text
    payload = json.loads((ROOT / "benchmarks" / "results" / "chapter_times_standard.json").read_text())
    assert all(r["outcome"] == "ran" for r in payload["rows"])
    section = page.read_text().split("(running-chapter-times)=", 1)[1].split("(running-threads)=", 1)[0]
    profiles = page.read_text().split("## Profiles and expected times", 1)[1].split("(running-chapter-times)=", 1)[0]
    assert hand_typed_measurements(section + profiles) == [], "hand-typed measured times on book/running.md"
