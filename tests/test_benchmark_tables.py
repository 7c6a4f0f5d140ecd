"""The tables benchmarks/grpo.py, checkpoint.py, muon_cost.py and muon_vs_adamw.py record,
built from hand-made metrics records, a goodput document and figures (worked out by hand
below). Pure Python: no jax program runs here (the muon scripts import jax, and run nothing)."""

from __future__ import annotations

from benchmarks import checkpoint, grpo


def _grpo_record(step, seconds, rate, length):
    return {
        "step": step,
        "step_time_s": seconds,
        "grpo/sample_tokens_per_second": rate,
        "grpo/completion_length": length,
    }


def test_grpo_speed_row_leaves_the_first_rollout_and_step_out():
    metrics = [
        _grpo_record(1, 9.0, 10.0, 8.0),  # the compiles: in no median
        _grpo_record(2, 0.5, 400.0, 8.0),  # 16 rows x 8 tokens / 400 = 0.32 s
        _grpo_record(3, 0.7, 800.0, 4.0),  # 16 x 4 / 800 = 0.08 s
        _grpo_record(4, 0.6, 1000.0, 5.0),  # 16 x 5 / 1000 = 0.08 s
    ]
    row = grpo.speed_row(metrics, rows_per_rollout=16, max_new_tokens=8)
    assert len(row) == len(grpo.SPEED_HEADER)
    # median of 400, 800, 1000 = 800; first 10; median of 0.32, 0.08, 0.08 s; of 0.5, 0.7, 0.6 s
    assert row == ["4", "16", "8", "800", "10", "0.0800", "0.600"]


def test_grpo_split_rows_per_step_shares_and_the_reference_note():
    doc = {
        "wall_s": 40.0,
        "seconds": {"sample": 10.0, "steps": 6.0, "compile": 8.0, "startup": 16.0, "data_wait": 0.0},
    }
    rows = {r[0]: r for r in grpo.split_rows(doc, steps=4)}
    assert rows["sample"][1:4] == ["10.00", "2.500", "25.0%"]
    assert rows["steps"][1:4] == ["6.00", "1.500", "15.0%"]
    assert rows["checkpoint_save"][1:4] == ["0.00", "0.000", "0.0%"]  # absent: zero
    assert rows["reference"] == ["reference", "-", "-", "-", grpo.REFERENCE_NOTE]
    assert rows["wall"][1:4] == ["40.00", "10.000", "100.0%"]
    assert all(len(r) == len(grpo.SPLIT_HEADER) for r in rows.values())


def test_checkpoint_step_rows_against_the_run_without_checkpoints():
    def run(times, blocked_key=None, blocked=()):
        records = [{"step": i + 1, "step_time_s": t} for i, t in enumerate(times)]
        for step, b in blocked:
            records[step - 1][blocked_key] = b
        return records

    base = run([5.0, 1.0, 1.0, 1.0])
    saved = run([5.0, 1.1, 1.2, 1.1], "checkpoint_blocked_s", [(2, 0.05), (4, 0.15)])
    local = run([5.0, 1.0, 1.05, 1.0], "local_checkpoint_blocked_s", [(2, 0.002), (3, 0.004), (4, 0.003)])
    rows = checkpoint.step_rows(
        [
            ("no checkpoints", base, None),
            ("save every 2", saved, "checkpoint_blocked_s"),
            ("local tier every 1", local, "local_checkpoint_blocked_s"),
        ]
    )
    assert rows[0] == ["no checkpoints", "1.000", "1.000", "-", "0", "-", "-"]
    # steps 2..4: mean 3.4 / 3, median 1.1 (+10%); blocked median 0.1 s = 100 ms, 9.1% of 1.1 s
    assert rows[1] == ["save every 2", "1.133", "1.100", "+10.0%", "2", "100.0", "9.1%"]
    # mean 3.05 / 3, median 1.0 (+0%); blocked median 3 ms = 0.3% of 1.0 s
    assert rows[2] == ["local tier every 1", "1.017", "1.000", "+0.0%", "3", "3.0", "0.3%"]
    assert all(len(r) == len(checkpoint.STEP_HEADER) for r in rows)


def test_muon_cost_rows_from_hand_made_figures():
    from benchmarks import muon_cost

    figures = {
        "matrices": [
            {"param": "wq", "count": 2, "hf_shape": [8, 8]},
            {"param": "wo", "count": 3, "hf_shape": [8, 8]},
        ],
        "muon_params": 3_000_000,
        "params": 4_500_000,
        "ns_steps": 5,
        "ns_dtype": "float32",
        "ns_flops_counted": 2e12,
        "ns_flops_xla": 2.002e12,  # 0.1% above the count
        "ns_bytes_accessed_xla": 3.4e9,
        "step_model_flops": 10e12,
        "state_bytes_adamw_f32": 2**31,
        "state_bytes_muon_f32": 3 * 2**29,
    }
    rows = muon_cost.cost_rows(figures)
    assert rows == [
        ["parameters Muon updates (5 matrices)", "-", "3.0 M of 4.5 M"],
        [
            "Newton-Schulz FLOPs per step (5 steps, float32; counted, XLA's count within 0.10%)",
            "-",
            "2.0 TFLOP",
        ],
        ["the step's model FLOPs (6 N + attention)", "10.0 TFLOP", "10.0 TFLOP"],
        ["Newton-Schulz bytes accessed per step (XLA:CPU's cost model, unfused)", "-", "3 GB"],
        ["optimizer state, float32", "2.00 GiB", "1.50 GiB"],
    ]
    compiled = {"argument": 2**30, "temp": 2**29, "total": 3 * 2**29}
    figures["h100_compiled_memory"] = {"adamw": compiled, "muon": {k: v // 2 for k, v in compiled.items()}}
    assert muon_cost.cost_rows(figures)[5:] == [
        ["H100 compiled: arguments (params + state + batch)", "1.00 GiB", "0.50 GiB"],
        ["H100 compiled: temporaries", "0.50 GiB", "0.25 GiB"],
        ["H100 compiled: total", "1.50 GiB", "0.75 GiB"],
    ]
    assert all(len(r) == len(muon_cost.COST_HEADER) for r in muon_cost.cost_rows(figures))


def test_muon_vs_adamw_rows_take_each_best_lr_and_the_last_ten_steps():
    from benchmarks import muon_vs_adamw

    figures = {
        "best_lr": {"adamw": 0.003, "muon": 0.01},
        "curves": {
            "adamw lr=0.001": [9.0] * 12,  # not the best: in no row
            "adamw lr=0.003": [6.0] + [3.0] * 5 + [2.0] * 6,  # last 10: (4 x 3 + 6 x 2) / 10 = 2.4
            "muon lr=0.01": [5.5] + [1.0] * 11,
        },
        "muon_bf16_state_curve": [5.5] + [1.0] * 10 + [1.1],  # last 10: (9 x 1.0 + 1.1) / 10 = 1.01
    }
    assert muon_vs_adamw.loss_rows(figures) == [
        ["adamw", "0.003", "6.000", "2.400"],
        ["muon", "0.01", "5.500", "1.000"],
        ["muon, bfloat16 state", "0.01", "5.500", "1.010"],
    ]


def test_presets_compile_row_from_a_hand_made_report():
    """benchmarks/presets.py's `compile` row: GiB are bytes / 2^30 (80 GiB = 85899345920 B), the
    mesh's axes of size 1 left out, a report that does not fit says so, and an estimate shows
    its step and MFU."""
    from benchmarks import presets

    gib = 2**30
    report = {
        "target": "gpu:h100 1 host(s) x 8 GPUs", "mesh": {"fsdp": 8, "tensor": 1},
        "global_batch_size": 8, "seq_len": 4096, "attention_impl": "pallas", "hbm_bytes": 80 * gib,
        "memory": {"total": 60 * gib, "argument": 20 * gib, "temp": 40 * gib}, "fits": True,
    }  # fmt: skip
    assert presets.compile_row("gpt-oss-20b", report) == [
        "gpt-oss-20b", "gpu:h100 1 host(s) x 8 GPUs", "fsdp=8, 8 x 4096", "pallas",
        "60.0 of 80.0 GiB (args 20.0, temp 40.0)", "-",
    ]  # fmt: skip
    big = {**report, "memory": {"total": 90 * gib, "argument": 30 * gib, "temp": 60 * gib}, "fits": False}
    assert presets.compile_row("x", big)[4] == "90.0 of 80.0 GiB (args 30.0, temp 60.0): does not fit"
    estimated = {**report, "step_seconds_est": 1.234, "mfu_est": 0.4567}
    assert presets.compile_row("x", estimated)[5] == "1.23 s, 45.7%"
