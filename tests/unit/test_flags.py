"""The configuration layer: ``CLEAVE_*`` variables parsed like the flags they set, for every command."""

from __future__ import annotations

import argparse

import pytest

from services.decode_worker.server import build_decode_parser
from services.prefill_worker.server import build_prefill_parser
from services.router.settings import parse_settings
from shared import flags
from shared.cli import engine_config_from_args


def _worker_args(env: dict[str, str], argv: list[str] | None = None) -> argparse.Namespace:
    # A named model directory: the default one would be converted on first use.
    return flags.parse_args(build_decode_parser(), argv or [], {"CLEAVE_MODEL": "/models/m", **env})


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0", True), ("false", True), ("off", True), ("", True), ("1", False), ("TRUE", False), ("yes", False)],
)
def test_no_prefix_caching_zero_keeps_caching_on(text: str, expected: bool) -> None:
    args = _worker_args({"CLEAVE_NO_PREFIX_CACHING": text})
    assert engine_config_from_args(args).enable_prefix_caching is expected


def test_values_are_parsed_like_the_flag() -> None:
    args = _worker_args({"CLEAVE_KV_CACHE_MEMORY": "512MiB", "CLEAVE_BLOCK_SIZE": "32", "CLEAVE_MAX_MODEL_LEN": "256"})
    config = engine_config_from_args(args)
    assert (config.kv_cache_memory, config.block_size, config.max_model_len) == (512 << 20, 32, 256)


def test_command_line_wins_over_environment() -> None:
    args = _worker_args({"CLEAVE_BLOCK_SIZE": "32", "CLEAVE_PORT": "7000"}, ["--block-size", "8"])
    assert (args.block_size, args.port) == (8, 7000)


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        ("CLEAVE_BLOCK_SIZE", "sixteen", "invalid literal"),
        ("CLEAVE_DTYPE", "float8", "must be one of"),
        ("CLEAVE_ENFORCE_EAGER", "maybe", "is not a boolean"),
    ],
)
def test_bad_value_names_the_variable(name: str, value: str, words: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _worker_args({name: value})
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{name}={value!r}" in err and words in err


def test_router_repeatable_flags_take_lists_and_flags_replace_them() -> None:
    env = {"CLEAVE_MODEL": "m", "CLEAVE_DECODE_WORKER": "a:1, b:2", "CLEAVE_PREFILL_WORKER": "p:1"}
    settings = parse_settings([], env)
    assert settings.decode_workers == ("a:1", "b:2") and settings.prefill_workers == ("p:1",)
    settings = parse_settings(["--decode-worker", "c:3"], env)
    assert settings.decode_workers == ("c:3",)


def test_router_model_required_unless_set_in_environment(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_settings([], {})
    assert parse_settings([], {"CLEAVE_MODEL": "m", "CLEAVE_LOG_LEVEL": "DEBUG"}).log_level == "debug"


def test_help_names_every_variable(capsys) -> None:
    parser = build_prefill_parser()
    with pytest.raises(SystemExit):
        flags.parse_args(parser, ["--help"], {})
    out = capsys.readouterr().out
    for name in ("CLEAVE_NO_PREFIX_CACHING", "CLEAVE_KV_CACHE_MEMORY", "CLEAVE_ADVERTISE_ADDR", "CLEAVE_METRICS_PORT"):
        assert name in out


def test_cleave_reads_the_environment_for_the_chosen_command_only(tmp_path, monkeypatch, capsys) -> None:
    from shared.cli import main

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("CLEAVE_MAX_MODEL_LEN", "abc")  # an engine flag: `generate` reads it, `demo-model` does not
    assert main(["demo-model", str(tmp_path), "--if-missing"]) == 0
    assert "already" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "hi", "--model", str(tmp_path)])
    assert exc.value.code == 2 and "CLEAVE_MAX_MODEL_LEN='abc'" in capsys.readouterr().err


@pytest.mark.parametrize("text,cpus", [("0", {0}), ("0,2-3", {0, 2, 3}), (" 1 , 4-5 ", {1, 4, 5}), ("3-3", {3})])
def test_cpu_lists_read_as_the_kernel_writes_them(text: str, cpus: set[int]) -> None:
    assert flags.parse_cpu_list(text) == cpus
    assert flags.parse_cpu_list(flags.format_cpu_list(cpus)) == cpus


@pytest.mark.parametrize("text", ["", "a", "1-", "-1", "2,,3", "1-x", "3-1"])
def test_bad_cpu_lists_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="CPU"):
        flags.parse_cpu_list(text)


def test_worker_io_cpus_flag_and_variable() -> None:
    assert _worker_args({}).io_cpus is None
    assert _worker_args({}, ["--io-cpus", "0-1"]).io_cpus == {0, 1}
    assert _worker_args({"CLEAVE_IO_CPUS": "2,4"}).io_cpus == {2, 4}
