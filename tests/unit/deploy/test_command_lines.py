"""Every Cleave command line in the chart and the compose file parses with the real CLI.

Each container's arguments and ``CLEAVE_*`` environment go through the same
argument parser and configuration layer the process itself uses, so a renamed
flag, a bad value or a variable no flag reads fails here instead of in a cluster.
"""

from __future__ import annotations

import argparse
import re

import pytest

from services.decode_worker.server import build_decode_parser
from services.planner.__main__ import build_parser as planner_parser
from services.prefill_worker.server import build_prefill_parser
from services.router.settings import build_parser as router_parser
from services.router.settings import parse_settings
from shared import flags
from shared.cli import build_parser as cleave_parser
from shared.tools.smoke import build_parser as smoke_parser
from tests.helpers.deploy import VALUES_SETS, compose_config, pod_specs, render

# What the downward API and Secrets would put into the environment.
FIELD_VALUES = {"status.podIP": "10.1.2.3", "metadata.name": "t-cleave-decode-5d9c7-abcde"}


def _subcommand(name: str) -> argparse.ArgumentParser:
    parser, _ = cleave_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[name]


PARSERS = {
    "router": lambda env: router_parser(env),
    "prefill-worker": lambda env: build_prefill_parser(),
    "decode-worker": lambda env: build_decode_parser(),
    "planner": lambda env: planner_parser(),
    "demo-model": lambda env: _subcommand("demo-model"),
    "shared.tools.smoke": lambda env: smoke_parser(),
}


def check_command(where: str, argv: list[str], env: dict[str, str]) -> None:
    """Parse one container's command line and environment like the process would."""
    if argv[:1] == ["cleave"]:
        argv = argv[1:]
    elif argv[:2] == ["python", "-m"]:
        argv = argv[2:]
    command, rest = argv[0], argv[1:]
    assert command in PARSERS, f"{where}: unknown command {command!r}"
    parser = PARSERS[command](env)
    try:
        flags.parse_args(parser, rest, env)
        if command == "router":
            parse_settings(rest, env)
    except SystemExit as e:
        pytest.fail(f"{where}: `{' '.join(argv)}` with {env} does not parse (exit {e.code})")
    unread = {name for name in env if name.startswith("CLEAVE_")} - set(flags.env_actions(parser))
    assert not unread, f"{where}: no flag of `{command}` reads {sorted(unread)}"


def _k8s_env(container: dict) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            # Kubernetes expands $(VAR) from variables defined before this one.
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), item["value"])
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = FIELD_VALUES[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[item["name"]] = "from-a-secret"
    return env


@pytest.mark.parametrize("values_set", VALUES_SETS)
def test_chart_command_lines_parse(values_set: str) -> None:
    checked = 0
    for name, spec in pod_specs(render(values_set)):
        for container in spec.get("initContainers", []) + spec["containers"]:
            if container["name"] == "redis":
                continue
            argv = container.get("command", []) + container.get("args", [])
            check_command(f"{values_set}/{name}/{container['name']}", argv, _k8s_env(container))
            checked += 1
    assert checked >= 4


def test_compose_command_lines_parse() -> None:
    services = compose_config()["services"]
    cleave = {name: s for name, s in services.items() if s["image"].startswith("cleave:")}
    assert set(cleave) == {"demo-model", "router", "prefill", "decode"}
    for name, service in cleave.items():
        check_command(f"compose/{name}", ["cleave", *service["command"]], _compose_env(service))


def _compose_env(service: dict) -> dict[str, str]:
    # A variable without a value passes through from the shell, and is unset when the shell has none.
    return {k: str(v) for k, v in (service.get("environment") or {}).items() if v is not None}


def test_compose_router_finds_workers_in_redis_and_takes_the_api_key_from_the_shell() -> None:
    router = compose_config()["services"]["router"]
    env = _compose_env(router)
    assert env["CLEAVE_REDIS_URL"] == "redis://redis:6379/0" and "CLEAVE_API_KEY" not in env
    assert not {"CLEAVE_PREFILL_WORKER", "CLEAVE_DECODE_WORKER"} & set(env)
    keyed = compose_config(shell=(("CLEAVE_API_KEY", "k3y"),))["services"]["router"]
    assert _compose_env(keyed)["CLEAVE_API_KEY"] == "k3y"
    check_command("compose/router", ["cleave", *keyed["command"]], _compose_env(keyed))
    settings = parse_settings(keyed["command"][1:], _compose_env(keyed))
    assert settings.api_key == "k3y" and settings.redis_url == "redis://redis:6379/0"
    assert settings.routing_policy == "kv_aware"


def test_a_renamed_flag_is_caught() -> None:
    with pytest.raises(pytest.fail.Exception):
        check_command("example", ["cleave", "decode-worker", "--kv-cache-size", "1GiB"], {})
    with pytest.raises(AssertionError, match="CLEAVE_KV_CACHE_SIZE"):
        check_command("example", ["cleave", "decode-worker"], {"CLEAVE_KV_CACHE_SIZE": "1GiB"})
    with pytest.raises(pytest.fail.Exception):
        check_command("example", ["cleave", "prefill-worker"], {"CLEAVE_NO_PREFIX_CACHING": "maybe"})
