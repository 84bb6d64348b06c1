"""server.core.batching_policy: where a model's batching comes from (flags, TF Serving's batching
parameters file, the model's own block), field by field, and every refusal named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from server.config import parse_settings
from server.core.batching_policy import (
    BatchingPolicy,
    apply,
    auto_bound,
    busy_share,
    dispatch_at,
    padded_rows,
    parse_batching_parameters,
    read_batching_parameters_file,
    server_policy,
)
from server.core.model_config import CHECK_BASE, ConfigError, parse_config_text

BASE = BatchingPolicy(max_batch_size=64, batch_timeout_s=None, max_inflight_batches=1, max_queued_rows=4096)


def params(text: str) -> BatchingPolicy:
    return apply(BASE, parse_batching_parameters(text, "batching.config"))


def test_the_flags_make_the_server_policy() -> None:
    settings = parse_settings(["--max-batch-size", "8", "--batch-timeout-ms", "2.5", "--max-inflight-batches", "3",
                               "--max-queued-rows", "100", "--allowed-batch-sizes", "2,8"], environ={})
    assert server_policy(settings) == BatchingPolicy(8, 0.0025, 3, 100, (2, 8))
    assert server_policy(parse_settings([], environ={})) == BASE


def test_tf_serving_file_fields_map_to_the_knobs() -> None:
    policy = params("max_batch_size { value: 32 }\nbatch_timeout_micros { value: 1500 }\n"
                    "max_enqueued_batches { value: 10 }\nnum_batch_threads { value: 4 }\n"
                    'thread_pool_name { value: "ignored" }\nallowed_batch_sizes: 8\nallowed_batch_sizes: 32\n'
                    "enable_large_batch_splitting { value: true }\nmax_execution_batch_size { value: 32 }\n")
    assert policy == BatchingPolicy(max_batch_size=32, batch_timeout_s=0.0015, max_inflight_batches=4,
                                    max_queued_rows=320, allowed_batch_sizes=(8, 32))


def test_unset_fields_keep_the_base_and_minus_one_is_auto() -> None:
    assert params("") == BASE
    assert params("batch_timeout_micros { value: 0 }").batch_timeout_s == 0.0
    assert params("batch_timeout_micros { value: -1 }").batch_timeout_s is None
    assert params("num_batch_threads { value: 3 }") == BatchingPolicy(64, None, 3, 4096)


def test_a_latency_target_comes_from_the_flag_or_the_models_own_field() -> None:
    assert BASE.target_latency_s is None and "target" not in BASE.describe()
    flagged = server_policy(parse_settings(["--target-latency-ms", "20"], environ={}))
    assert flagged.target_latency_s == 0.02 and flagged.describe().endswith("target_latency=20ms")
    assert params("target_latency_ms { value: 7.5 }").target_latency_s == 0.0075
    with pytest.raises(ValueError, match="target_latency_ms must be > 0, got 0"):
        params("target_latency_ms { value: 0 }")
    with pytest.raises(SystemExit):
        parse_settings(["--target-latency-ms", "-3"], environ={})


def test_a_source_that_sets_one_size_field_sets_both() -> None:
    """Sizes inherited from the flags never disagree with a maximum set below them."""
    base = BatchingPolicy(16, None, 2, 100, allowed_batch_sizes=(4, 16))
    assert apply(base, parse_batching_parameters("max_batch_size { value: 8 }", "f")) == BatchingPolicy(8, None, 2, 100)
    assert apply(base, parse_batching_parameters("allowed_batch_sizes: 2 allowed_batch_sizes: 6", "f")) == \
        BatchingPolicy(6, None, 2, 100, (2, 6))


def test_max_execution_batch_size_alone_is_the_largest_batch() -> None:
    """A block that sets only max_execution_batch_size is not checked against a maximum it does
    not set (it was refused at parse time, against a placeholder of 1)."""
    base = BatchingPolicy(16, None, 2, 100, allowed_batch_sizes=(4, 16))
    assert apply(base, parse_batching_parameters("max_execution_batch_size { value: 8 }", "f")) == \
        BatchingPolicy(8, None, 2, 100)
    assert apply(CHECK_BASE, parse_batching_parameters("max_execution_batch_size { value: 8 }", "f")) == \
        BatchingPolicy(8, None, 1, 1)


def test_max_batch_size_0_turns_batching_off_for_the_model() -> None:
    base = BatchingPolicy(16, None, 2, 100)
    off = apply(base, parse_batching_parameters("max_batch_size { value: 0 }", "f"))
    assert off == BatchingPolicy(16, None, 2, 100, batching=False)
    assert off.describe() == "off (each request runs alone) inflight=2 max_queued_rows=100"


@pytest.mark.parametrize(("text", "message"), [
    ("max_batch_size { value: -1 }", "max_batch_size must be >= 1, got -1"),
    ("max_batch_size { value: 0 } allowed_batch_sizes: 2", "max_batch_size 0 (no batching) takes no allowed"),
    ("batch_timeout_micros { value: -2 }", "batch_timeout_micros must be >= 0 (or -1 for auto), got -2"),
    ("num_batch_threads { value: 0 }", "batches in flight must be >= 1, got 0"),
    ("max_enqueued_batches { value: 0 }", "max_queued_rows must be >= 1, got 0"),
    ("allowed_batch_sizes: 4 allowed_batch_sizes: 2",
     "allowed_batch_sizes must be positive and increasing, got [4, 2]"),
    ("max_batch_size { value: 8 } allowed_batch_sizes: 2 allowed_batch_sizes: 4",
     "the last of allowed_batch_sizes (4) must equal max_batch_size (8)"),
    ("max_batch_size { value: 8 } max_execution_batch_size { value: 4 }",
     "max_execution_batch_size 4 differs from max_batch_size 8"),
    ("pad_variable_length_inputs: true", "pad_variable_length_inputs is not supported"),
])
def test_unservable_fields_are_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        params(text)


def test_file_errors_name_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "batching.config"
    path.write_text("max_batch_size { value: 8 }\nmax_batch_sise { value: 8 }\n")
    with pytest.raises(ValueError, match=rf"^{path}:2:1 : .*max_batch_sise"):
        read_batching_parameters_file(BASE, path)
    path.write_text("max_batch_size { value: 8 }\nnum_batch_threads { value: 0 }\n")
    with pytest.raises(ValueError, match=rf"^{path}: batches in flight must be >= 1, got 0$"):
        read_batching_parameters_file(BASE, path)
    with pytest.raises(ValueError, match=r"cannot read batching parameters file .*missing"):
        read_batching_parameters_file(BASE, tmp_path / "missing")


def test_the_file_overrides_the_flags(tmp_path: Path) -> None:
    path = tmp_path / "batching.config"
    path.write_text("batch_timeout_micros { value: 0 }\nmax_batch_size { value: 16 }\n")
    settings = parse_settings(["--batch-timeout-ms", "5", "--max-inflight-batches", "3",
                               "--batching-parameters-file", str(path)], environ={})
    assert server_policy(settings) == BatchingPolicy(16, 0.0, 3, 4096)


def test_a_model_block_overrides_the_server_policy() -> None:
    (source,) = parse_config_text(
        'model_config_list { config { name: "a" base_path: "/a"\n'
        "  batching_parameters { max_batch_size { value: 8 } batch_timeout_micros { value: 2000 } } } }",
        "models.config")
    assert source.batching is not None
    assert apply(BASE, source.batching) == BatchingPolicy(8, 0.002, 1, 4096)


def test_a_bad_model_block_is_a_config_error_naming_model_and_line() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config_text('model_config_list {\n config { name: "a" base_path: "/a" }\n'
                          ' config { name: "b" base_path: "/b"\n'
                          "   batching_parameters { num_batch_threads { value: 0 } } }\n}", "models.config")
    assert str(info.value) == ("models.config:3: model 'b' batching_parameters: batches in flight must be >= 1, "
                               "got 0")


@pytest.mark.parametrize(("sizes", "rows", "expected"), [
    ((), 5, 5), ((2, 4, 8), 1, 2), ((2, 4, 8), 4, 4), ((2, 4, 8), 5, 8), ((2, 4, 8), 8, 8),
])
def test_padded_rows(sizes: tuple[int, ...], rows: int, expected: int) -> None:
    assert padded_rows(sizes, rows) == expected


def test_warm_up_sizes_are_the_sizes_the_model_will_see() -> None:
    assert BatchingPolicy(64, None, 1, 1).warm_up_sizes() == (1, 2, 4, 8, 16, 32, 64)
    assert BatchingPolicy(12, None, 1, 1).warm_up_sizes() == (1, 2, 4, 8, 12)
    assert BatchingPolicy(12, None, 1, 1, (3, 12)).warm_up_sizes() == (3, 12)


def test_describe_says_every_knob() -> None:
    assert BASE.describe() == ("max_batch_size=64 batch_timeout=auto inflight=1 max_queued_rows=4096 "
                               "allowed_batch_sizes=any")
    assert BatchingPolicy(8, 0.0005, 1, 10, (4, 8)).describe() == (
        "max_batch_size=8 batch_timeout=0.5ms inflight=1 max_queued_rows=10 allowed_batch_sizes=4,8")


# The auto rule as pure functions (rule 2), exact ----------------------------------------------


def test_busy_share_is_loop_cpu_over_wall_time() -> None:
    assert busy_share(0.2, 0.05) == 0.25
    assert busy_share(0.0, 0.05) == 0.0


def test_auto_bound_is_the_fixed_cost_stretched_by_the_busy_loop_and_capped_by_a_full_batch() -> None:
    assert auto_bound(0.01, 0.0, 64, 0.001) == 0.01
    assert auto_bound(0.01, 0.75, 64, 0.001) == pytest.approx(0.04)
    assert auto_bound(0.01, 0.75, 8, 0.001) == 0.008  # a full batch arrives sooner than that
    assert auto_bound(0.01, 1.0, 8, 0.001) == 0.008


def test_dispatch_with_a_timeout_is_that_long_after_the_oldest_row() -> None:
    def never() -> float:
        raise AssertionError("the auto bound is not needed with a timeout")

    assert dispatch_at(10.0, 0.5, 1, 0.2, never, 0.001, 1, 4, 9.0) == 10.5


def test_dispatch_beside_a_running_batch_is_at_most_one_batch_time_after_the_oldest_row() -> None:
    def never() -> float:
        raise AssertionError("the auto bound is not needed beside a running batch")

    assert dispatch_at(10.0, None, 1, 0.2, never, 0.001, 1, 4, 9.0) == pytest.approx(10.2)


@pytest.mark.parametrize(("row_gap", "rows_here", "expected"), [
    (0.02, 1, 10.0),   # under one more row expected within the bound: at once
    (0.001, 4, 10.0),  # every row lately present is here: at once
    (0.001, 2, 10.01),  # rows coming, some missing: the bound after the oldest row
])
def test_dispatch_on_a_free_model(row_gap: float, rows_here: int, expected: float) -> None:
    assert dispatch_at(10.0, None, 0, 0.2, lambda: 0.01, row_gap, rows_here, 4, 9.0) == pytest.approx(expected)


def test_dispatch_waits_from_when_the_model_fell_free_if_that_is_later() -> None:
    assert dispatch_at(10.0, None, 0, 0.2, lambda: 0.01, 0.001, 2, 4, 10.5) == pytest.approx(10.51)
