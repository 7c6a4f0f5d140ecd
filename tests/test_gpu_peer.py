"""benchmarks/gpu_peer.py's logic without torch or a GPU: the torch runs it builds from its
flags, the step-time statistics over repeats, the parameter-count check and the memory
pairing. (The torch path itself was run by hand on CPU at --tiny; the GPU figures need a GPU.)"""

from __future__ import annotations

import pytest

from benchmarks import gpu_peer, torch_peer

GIB = 2**30


def args_of(*argv: str):
    ap = gpu_peer.parser()
    args = ap.parse_args(list(argv))
    return ap, args


def test_repeats_are_windows_of_timed_steps_after_the_warmup():
    # hand-made: warmup 2 (slow), then repeat 1 = 1..20 (median 10.5), repeat 2 = 21..40 (30.5)
    times = [100.0, 90.0, *[float(i) for i in range(1, 41)], 500.0]
    stats = gpu_peer.window_stats(times, warmup=2, steps=20, repeats=2)
    assert stats["per_repeat_s"] == [10.5, 30.5]
    assert stats["step_time_s"] == 20.5  # median of the two
    assert (stats["step_time_min_s"], stats["step_time_max_s"]) == (10.5, 30.5)
    with pytest.raises(ValueError, match="expected at least warmup 2 \\+ 3 x 20 = 62"):
        gpu_peer.window_stats(times, warmup=2, steps=20, repeats=3)


def test_torch_runs_take_the_flags_and_variants():
    ap, args = args_of(
        "--only",
        "torch-eager,torch-compile,torchtitan",
        "--torch-attention",
        "flash",
        "--torch-loss",
        "liger",
        "--torch-compile-mode",
        "max-autotune",
        "--torch-variants",
        "cudnn:attention=cudnn;full:remat=full compile=0",
    )
    runs = {r.label: r for r in gpu_peer.torch_runs(gpu_peer.check_args(ap, args), args)}
    assert runs["torch-eager"] == torch_peer.TorchRun(
        "torch-eager", compile=False, mode="max-autotune", attention="flash", loss="liger"
    )
    assert runs["torch-compile"].compile and runs["torch-compile"].mode == "max-autotune"
    assert runs["torchtitan"].model == "torchtitan" and runs["torchtitan"].attention == "auto"
    assert runs["cudnn"].attention == "cudnn" and runs["cudnn"].loss == "liger" and runs["cudnn"].compile
    assert runs["full"].remat == "full" and not runs["full"].compile
    assert runs["full"].describe() == "transformers, eager, sdpa flash, loss liger, remat full"


@pytest.mark.parametrize(
    "variants, message",
    [
        ("x:attention=fa3", "torch run 'x': attention='fa3': expected one of auto, cudnn, flash, efficient"),
        ("x:mode=reduce-overhead", "mode='reduce-overhead': expected one of default, max-autotune"),
        ("x:compile=yes", "compile='yes': expected 0 or 1"),
        ("x:speed=2", "expected KEY=VALUE"),
        ("x:model=torchtitan attention=cudnn", "torchtitan runs its own language-model attention"),
        ("torch-compile:loss=hf", "labels \\['torch-compile'\\] clash"),
    ],
)
def test_bad_torch_variants_are_refused_by_name(variants, message):
    ap, args = args_of("--torch-variants", variants)
    with pytest.raises(ValueError, match=message):
        gpu_peer.torch_runs(["torch-compile"], args)


def test_fewer_than_20_timed_steps_is_a_usage_error(capsys):
    ap, args = args_of("--steps", "10")
    with pytest.raises(SystemExit):
        gpu_peer.check_args(ap, args)
    assert "--steps=10: expected >= 20 timed steps per repeat" in capsys.readouterr().err


def test_cuda_only_choices_refuse_in_one_line_off_cuda():
    run = torch_peer.TorchRun
    assert "cudnn SDPA backend needs a CUDA device" in torch_peer.refusal(
        run("a", attention="cudnn"), cuda=False
    )
    assert "efficient SDPA" in torch_peer.refusal(run("a", attention="efficient"), cuda=False)
    assert "Triton, CUDA only" in torch_peer.refusal(run("a", loss="liger"), cuda=False)
    assert "FlexAttention" in torch_peer.refusal(run("a", model="torchtitan"), cuda=False)
    assert torch_peer.refusal(run("a", attention="flash"), cuda=False) is None  # torch has a CPU flash
    assert torch_peer.refusal(run("a", attention="cudnn", loss="liger"), cuda=True) is None


def test_parameter_counts_must_match_jaxtrains():
    rows = [
        {"contender": "jaxtrain (auto)", "side": "jaxtrain"},
        {"contender": "torch-compile", "side": "torch", "params": 886_000_000},
        {"contender": "torchtitan", "side": "torch", "params": 885_999_999},
        {"contender": "sdpa-cudnn", "side": "torch", "error": "exit 1"},
    ]
    assert gpu_peer.check_param_counts(886_000_000, rows) == [
        "torchtitan: 885,999,999 parameters, jaxtrain's model 886,000,000: not the same model"
    ]


def test_memory_is_paired_at_each_sides_default_and_at_the_same_remat():
    rows = [
        {
            "contender": "jaxtrain (auto)",
            "side": "jaxtrain",
            "remat": "minimal_with_context",
            "peak_memory_bytes": 22 * GIB,
        },
        {
            "contender": "jaxtrain (remat-none)",
            "side": "jaxtrain",
            "remat": "none",
            "peak_memory_bytes": 28 * GIB,
        },
        {"contender": "jaxtrain (full)", "side": "jaxtrain", "remat": "full", "peak_memory_bytes": 15 * GIB},
        {"contender": "torch-compile", "side": "torch", "remat": "none", "peak_memory_bytes": 35 * GIB},
        {"contender": "torch-full", "side": "torch", "remat": "full", "peak_memory_bytes": 20 * GIB},
    ]
    pairs = [
        (p["comparison"], p["jaxtrain"], p["torch"], round(p["ratio"], 4))
        for p in gpu_peer.memory_pairs(rows)
    ]
    assert pairs == [
        (
            "each side's default (jaxtrain remat minimal_with_context, torch none)",
            "jaxtrain (auto)",
            "torch-compile",
            0.6286,
        ),
        ("same remat: none", "jaxtrain (remat-none)", "torch-compile", 0.8),
        ("same remat: full", "jaxtrain (full)", "torch-full", 0.75),
    ]
    cells = gpu_peer.memory_cells(gpu_peer.memory_pairs(rows))
    assert cells[1] == ["same remat: none", "jaxtrain (remat-none)", "28.0", "torch-compile", "35.0", "0.80"]


def test_jaxtrains_remat_is_its_override_or_what_auto_resolved_to():
    auto = [
        "model.attention_impl=auto -> cudnn: ...",
        "model.remat=auto -> minimal_with_context: the fastest",
    ]
    assert gpu_peer.jaxtrain_remat([], auto) == "minimal_with_context"
    assert gpu_peer.jaxtrain_remat(["model.remat=none"], auto) == "none"
    assert gpu_peer.jaxtrain_remat([], []) == "auto"


def test_step_table_rows_have_the_headers_cells_and_the_fastest_torch_ratio():
    shape = {"batch": 8, "seq": 2048}
    rows = [
        {
            "contender": "jaxtrain (auto)",
            "side": "jaxtrain",
            "remat": "none",
            "auto": [],
            "env": {},
            "overrides": [],
            "step_time_s": 0.18,
            "step_time_min_s": 0.179,
            "step_time_max_s": 0.182,
            "peak_memory_bytes": 22 * GIB,
        },
        {
            "contender": "torch-compile",
            "side": "torch",
            "remat": "none",
            "setting": "transformers, compile default",
            "step_time_s": 0.22,
            "step_time_min_s": 0.21,
            "step_time_max_s": 0.23,
            "peak_memory_bytes": 35 * GIB,
            "sdpa_ops": [
                "aten::_scaled_dot_product_flash_attention",
                "aten::_scaled_dot_product_flash_attention_backward",
                "aten::scaled_dot_product_attention",
            ],
            "graphs": 3,
            "graph_breaks": 6,
        },
        {"contender": "torch-eager", "side": "torch", "remat": "none", "error": "exit 1: boom"},
    ]
    gpu_peer.add_figures(rows, shape, flops_token=6e9, peak=989e12)
    assert rows[0]["vs_fastest_torch"] == pytest.approx(0.22 / 0.18)
    assert rows[0]["tokens_per_second"] == pytest.approx(8 * 2048 / 0.18)
    cells = gpu_peer.contender_cells(rows)
    assert all(len(c) == len(gpu_peer.STEP_HEADER) for c in cells)
    assert cells[0][:7] == ["jaxtrain (auto)", "0.1800", "0.1790-0.1820", "91,022", "55.2%", "22.0", "1.22"]
    assert "ran _scaled_dot_product_flash_attention; 3 graphs, 6 graph breaks" in cells[1][-1]
