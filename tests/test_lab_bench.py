"""The benchmark's timing logic on the CPU, with a fake clock standing in for CUDA events."""

from types import SimpleNamespace

from lab import bench, bench_report


class _Clock:
    now_ms = 0.0


class _Event:
    def __init__(self, enable_timing=True):
        self.at = None

    def record(self):
        self.at = _Clock.now_ms

    def elapsed_time(self, end):
        return end.at - self.at


_FAKE_TORCH = SimpleNamespace(
    device=lambda name: name,
    bfloat16="bf16",
    randn=lambda *shape, device=None: SimpleNamespace(to=lambda dtype: ("tensor", shape)),
    cuda=SimpleNamespace(Event=_Event, synchronize=lambda: None),
)


def test_small_call_cost_is_the_median_of_interleaved_loops():
    # us per call in each round: one slow round (a hiccup of the host) must not decide the result
    per_round = [12.0, 11.0, 60.0, 10.0, 13.0, 9.0, 14.0]
    assert len(per_round) == bench.SMALL_CALL_ROUNDS
    state = {"calls": 0}
    n_per_loop = None

    def fake_cudnn(q, k, v, p, cu):
        state["calls"] += 1
        if state["calls"] == 1:
            return  # the warm-up call
        loop = (state["calls"] - 2) // n_per_loop
        _Clock.now_ms += per_round[loop] / 1e3

    # loops of 200 calls each
    n_per_loop = 200
    rows = bench.measure_startup({"cudnn": fake_cudnn}, _FAKE_TORCH, small_cases=bench.SMALL_CASES[:1])
    (row,) = [r for r in rows if r["kind"] == "small_call"]
    assert state["calls"] == 1 + bench.SMALL_CALL_ROUNDS * n_per_loop
    assert [round(x, 6) for x in row["us_per_loop"]] == per_round
    assert round(row["us_per_call"], 6) == 12.0  # median of the seven loops


def test_the_report_names_points_whose_rounds_disagree(tmp_path, monkeypatch):
    """Rounds of one kernel that land more than 5% apart are listed with their spread, so that a
    reader of the table sees which cells the run's own noise makes doubtful."""
    point = bench.asdict(bench.Point(2, 8192, 16, 16, 128, False))
    rows = [dict(point=point, impl="fmha", ms=1.0, ms_rounds=[1.0, 1.08, 1.01], tflops=600.0),
            dict(point=point, impl="fa4", ms=1.0, ms_rounds=[1.0, 1.01, 1.0], tflops=600.0)]
    spreads = bench_report.round_spreads(rows)
    assert [impl for _, impl, _ in spreads] == ["fmha", "fa4"]
    assert abs(spreads[0][0] - 0.08) < 1e-9
    monkeypatch.setattr(bench_report, "_plot", lambda *a, **k: None)  # no plotting library needed for the text
    text = bench_report.write_reports(rows, str(tmp_path), dict(device="GPU", date="today", command="x"))
    noise = next(line for line in text.splitlines() if line.startswith("- noise"))
    assert "fmha B2 S8192 H16/16 D128 (8.0%)" in noise and "fa4 B2" not in noise


def test_profile_runs_group_instructions_by_executions_per_cta(tmp_path):
    """``lab.profile_kernel --runs-per-cta``: consecutive instructions that run equally often per
    CTA form one run, with their share of the stall samples."""
    from lab.profile_kernel import runs_per_cta

    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"]
    rows = [("0x0", "LDC R1", 10, 24), ("0x10", "S2R R0", 10, 24),  # setup: 12 warps x 2 CTAs
            ("0x20", "HGMMA a", 60, 160), ("0x30", "HGMMA b", 0, 160),  # the loop: 8 warps x 10 tiles
            ("0x40", "STG c", 20, 16)]  # epilogue: 8 warps
    csv_path = tmp_path / "sass.csv"
    csv_path.write_text("\n".join(",".join(f'"{v}"' for v in r) for r in [header, *rows]) + "\n")
    table = runs_per_cta(str(csv_path), ctas=2).splitlines()[2:]
    assert table == ["| 0-1 | 12.0 | 20.0% | `LDC R1` |", "| 2-3 | 80.0 | 60.0% | `HGMMA a` |",
                     "| 4-4 | 8.0 | 20.0% | `STG c` |"]


def test_profile_phases_cut_a_loop_at_its_synchronizations(tmp_path):
    """``lab.profile_kernel --phases``: the work between two waits is one row with its samples
    summed; each wait, barrier or fence is a row of its own."""
    from lab.profile_kernel import phases

    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"]
    rows = [("0x0", "HGMMA.64x64x16 a", 5, 8), ("0x10", "UIADD3 b", 1, 8),
            ("0x20", "WARPGROUP.DEPBAR.LE gsb0, 0x0", 40, 8),
            ("0x30", "MUFU.EX2 R1, R1", 7, 8), ("0x40", "@P0 MUFU.EX2 R2, R2", 3, 8),
            ("0x50", "FENCE.VIEW.ASYNC.S", 9, 8)]
    csv_path = tmp_path / "sass.csv"
    csv_path.write_text("\n".join(",".join(f'"{v}"' for v in r) for r in [header, *rows]) + "\n")
    table = phases(str(csv_path), 0, 5).splitlines()[2:]
    assert table == ["| 0-1 | 6 | HGMMA x1, UIADD3 x1 |", "| 2 | 40 | `WARPGROUP.DEPBAR.LE gsb0, 0x0` |",
                     "| 3-4 | 10 | MUFU x2 |", "| 5 | 9 | `FENCE.VIEW.ASYNC.S` |"]


def test_profile_step_names_kernels_by_module_and_class():
    from lab.profile_step import short_kernel_name

    dsl = ("kernel_cutlass_kernel_fmhakernelshopperfwdHopperAttentionForward_object_at__TiledMMA_ThrLayoutVMNK"
           "128211112800_tensorptrf8")
    assert short_kernel_name(dsl) == "fmhakernelshopperfwdHopperAttentionForward"
    torch_kernel = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, " + "x" * 80
    assert short_kernel_name(torch_kernel) == torch_kernel[:70]


def test_the_report_divides_by_every_peer_and_finds_fp8s_bf16_twin_in_any_group(tmp_path, monkeypatch):
    """FA3 and cuDNN's fp8 get ratio columns; the bf16 summary against FA3 counts every bf16 group;
    an fp8 point is compared with our bf16 of the same shape, also outside the standard grid."""
    P = bench.Point
    d256 = bench.asdict(P(2, 8192, 8, 8, 256, True, "d256"))
    d256_fp8 = bench.asdict(P(2, 8192, 8, 8, 256, True, "fp8", dtype="float8_e4m3fn"))
    std = bench.asdict(P(1, 16384, 16, 16, 128, False))
    t = lambda pt, impl, tf: dict(point=pt, impl=impl, ms=1.0, tflops=tf)
    rows = [t(std, "fmha", 650.0), t(std, "fa3", 650.0), t(std, "fa4", 500.0),
            t(d256, "fmha", 600.0), t(d256, "fa3", 500.0), t(d256, "fa4", 600.0),
            t(d256_fp8, "fmha", 960.0), t(d256_fp8, "fa3", 1200.0), t(d256_fp8, "cudnn_fp8", 800.0),
            dict(point=d256_fp8, impl="fa4", error="NotImplementedError: no fp8")]
    monkeypatch.setattr(bench_report, "_plot", lambda *a, **k: None)
    text = bench_report.write_reports(rows, str(tmp_path), dict(device="GPU", date="today", command="x"))
    lines = text.splitlines()
    assert lines[4].endswith("| fmha / fa4 | fmha / fa3 | fmha / cudnn_fp8 |")
    fp8_row = next(line for line in lines if line.startswith("| B2 S8192 H8/8 D256 causal fp8 |"))
    assert fp8_row.endswith("| 960 | 1200 | n/a | 800 | - | 0.80 | 1.20 |")  # columns in first-seen order
    assert "- all bf16 points, fmha/fa3: median 1.10, min 1.00 over 2 points" in text
    assert "- fp8, fmha/cudnn_fp8: median 1.20, min 1.20, max 1.20 over 1 points" in text
    assert "- fp8 / bf16 (fmha, B2 S8192 H8/8 D256 causal fp8): 1.60" in text


def test_nsa_bench_lists_are_valid_selections_with_the_forced_blocks():
    """lab/bench_nsa's lists pass fmha.nsa's checks (range, no duplicates) and hold the current,
    previous and first blocks of each token, ascending."""
    import torch

    from fmha.nsa.checks import check_selected
    from lab.bench_nsa import BLOCK, selection_lists

    sel = selection_lists(700, 2, 4, torch.Generator().manual_seed(0), "cpu")
    check_selected(sel, torch.zeros(700, 2, 8), torch.tensor([0, 700], dtype=torch.int32), BLOCK)
    t = torch.arange(700).view(-1, 1, 1)
    for forced in (t // BLOCK, (t // BLOCK - 1).clamp(min=0), torch.zeros_like(t)):
        assert bool((sel == forced).any(-1).all())
    valid = sel >= 0
    assert bool(((sel[..., 1:] > sel[..., :-1]) | ~valid[..., 1:]).all())
