"""The flag blocks the three servers share (tandem_wire/server_flags.py): each block fills the
fields its struct names, with the struct's defaults, from flags or the server's environment;
each server's config carries those fields alike, and reads only its own variables."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from engine_service import config as engine_config
from gateway_service import config as gateway_config
from store_service import config as store_config
from tandem_wire.server_flags import (
    AUTH_FILE_HELP,
    INSECURE_NO_AUTH_HELP,
    LISTEN_HELP,
    METRICS_LISTEN_HELP,
    AuthFlags,
    Block,
    EnvDefaults,
    LogFlags,
    MetricsFlags,
    TlsFlags,
    add_auth_args,
    add_grace_arg,
    add_listen_arg,
    add_log_args,
    add_metrics_arg,
    add_off_switch,
    add_tls_args,
    config_fields,
)

ENV = EnvDefaults("TANDEM_TEST_")
BLOCKS: list[tuple[Block, Callable[[argparse.ArgumentParser, EnvDefaults], None]]] = [
    (TlsFlags, add_tls_args),
    (AuthFlags, add_auth_args),
    (LogFlags, add_log_args),
    (MetricsFlags, add_metrics_arg),
]
GATEWAY = ["--engine", "e:1", "--http-listen", "127.0.0.1:0"]
# Each server, the blocks its config takes, and the arguments it needs to parse at all.
SERVERS: list[tuple[str, Callable[[list[str]], Any], list[Block], list[str]]] = [
    ("ENGINE", engine_config.parse_args, [TlsFlags, AuthFlags, LogFlags, MetricsFlags], []),
    ("STORE", store_config.parse_args, [TlsFlags, AuthFlags, LogFlags, MetricsFlags], []),
    ("GATEWAY", gateway_config.parse_args, [AuthFlags, LogFlags, MetricsFlags], GATEWAY),
]
CONFIGS = {
    "ENGINE": engine_config.EngineConfig,
    "STORE": store_config.StoreConfig,
    "GATEWAY": gateway_config.GatewayConfig,
}


def _parser(*adds: Callable[[argparse.ArgumentParser, EnvDefaults], None]) -> Any:
    p = argparse.ArgumentParser(prog="test")
    for add in adds:
        add(p, ENV)
    return p


@pytest.mark.parametrize(("block", "add"), BLOCKS, ids=lambda x: getattr(x, "__name__", ""))
def test_each_block_fills_its_structs_fields_with_its_defaults(
    block: Block, add: Callable[[argparse.ArgumentParser, EnvDefaults], None]
) -> None:
    parsed = _parser(add).parse_args([])
    assert vars(parsed) == dataclasses.asdict(block())
    assert block(**config_fields(parsed, block)) == block()


def test_flags_and_the_environment_fill_the_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    p = _parser(add_tls_args, add_auth_args, add_log_args, add_metrics_arg)
    every = (TlsFlags, AuthFlags, LogFlags, MetricsFlags)
    argv = "--tls-cert c --tls-key k --tls-client-ca ca --auth-file a.json --insecure-no-auth "
    argv += "--log-format json --log-level debug --metrics-listen 127.0.0.1:9"
    assert config_fields(p.parse_args(argv.split()), *every) == {
        "tls_cert": "c",
        "tls_key": "k",
        "tls_client_ca": "ca",
        "auth_file": "a.json",
        "insecure_no_auth": True,
        "log_format": "json",
        "log_level": "debug",
        "metrics_listen": "127.0.0.1:9",
    }
    for name, value in [
        ("TLS_CERT", "ec"),
        ("AUTH_FILE", "ea"),
        ("INSECURE_NO_AUTH", "1"),
        ("LOG_LEVEL", "warning"),
        ("METRICS_LISTEN", ":7"),
    ]:
        monkeypatch.setenv(f"TANDEM_TEST_{name}", value)
    p = _parser(add_tls_args, add_auth_args, add_log_args, add_metrics_arg)
    fields = config_fields(p.parse_args(["--log-level", "error"]), *every)
    assert fields["tls_cert"] == "ec" and fields["auth_file"] == "ea"
    assert fields["insecure_no_auth"] and fields["metrics_listen"] == ":7"
    assert fields["log_level"] == "error"  # a flag beats the environment


def test_log_flags_take_only_known_values(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        _parser(add_log_args).parse_args(["--log-format", "xml"])
    assert exited.value.code == 2
    assert "invalid choice: 'xml'" in capsys.readouterr().err


def test_listen_grace_and_off_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    def parser() -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog="test")
        add_listen_arg(p, ENV, "127.0.0.1:1")
        add_grace_arg(p, ENV, help="seconds")
        add_off_switch(p, ENV, "warm_up", "skip it")
        return p

    assert vars(parser().parse_args([])) == {
        "listen": "127.0.0.1:1",
        "grace": 10.0,
        "warm_up": True,
    }
    parsed = parser().parse_args(["--listen", ":2", "--grace", "2.5", "--no-warm-up"])
    assert vars(parsed) == {"listen": ":2", "grace": 2.5, "warm_up": False}
    monkeypatch.setenv("TANDEM_TEST_LISTEN", ":3")
    monkeypatch.setenv("TANDEM_TEST_GRACE", "4")
    monkeypatch.setenv("TANDEM_TEST_WARM_UP", "0")
    assert vars(parser().parse_args([])) == {"listen": ":3", "grace": 4.0, "warm_up": False}


def test_env_defaults_convert_like_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ENV("X", "d") == "d" and ENV.integer("X", 3) == 3 and ENV.real("X", 0.5) == 0.5
    assert not ENV.flag("X") and ENV.on_unless_zero("X")
    monkeypatch.setenv("TANDEM_TEST_X", "1")
    assert ENV("X", "d") == "1" and ENV.integer("X", 3) == 1 and ENV.real("X", 0.5) == 1.0
    assert ENV.flag("X") and ENV.on_unless_zero("X")
    monkeypatch.setenv("TANDEM_TEST_X", "0")
    assert not ENV.flag("X") and not ENV.on_unless_zero("X")
    monkeypatch.setenv("TANDEM_TEST_X", "yes")  # only "1" turns a flag on
    assert not ENV.flag("X") and ENV.on_unless_zero("X")
    with pytest.raises(ValueError):
        ENV.integer("X", 3)


@pytest.mark.parametrize("server", list(CONFIGS))
def test_each_config_declares_the_block_fields_as_the_structs_do(server: str) -> None:
    blocks = next(b for name, _, b, _ in SERVERS if name == server)
    declared = {f.name: f for f in dataclasses.fields(CONFIGS[server])}
    for block in blocks:
        for f in dataclasses.fields(block):
            assert f.name in declared, (server, f.name)
            assert (declared[f.name].type, declared[f.name].default) == (f.type, f.default)


@pytest.mark.parametrize(
    ("server", "parse", "blocks", "base"), SERVERS, ids=[s[0] for s in SERVERS]
)
def test_each_server_reads_the_shared_flags_from_its_own_variables(
    server: str,
    parse: Callable[[list[str]], Any],
    blocks: list[Block],
    base: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = parse(base)
    for block in blocks:
        assert block(**{f.name: getattr(config, f.name) for f in dataclasses.fields(block)}) == (
            block()
        )
    other = next(name for name in CONFIGS if name != server)
    monkeypatch.setenv(f"TANDEM_{other}_METRICS_LISTEN", ":1")
    monkeypatch.setenv(f"TANDEM_{other}_AUTH_FILE", "theirs.json")
    assert parse(base).metrics_listen == "" and parse(base).auth_file == ""
    monkeypatch.setenv(f"TANDEM_{server}_METRICS_LISTEN", ":2")
    monkeypatch.setenv(f"TANDEM_{server}_AUTH_FILE", "ours.json")
    monkeypatch.setenv(f"TANDEM_{server}_INSECURE_NO_AUTH", "1")
    monkeypatch.setenv(f"TANDEM_{server}_LOG_FORMAT", "json")
    config = parse(base)
    assert (config.metrics_listen, config.auth_file) == (":2", "ours.json")
    assert config.insecure_no_auth and config.log_format == "json"
    config = parse([*base, "--metrics-listen", ":3", "--log-format", "text"])
    assert (config.metrics_listen, config.log_format) == (":3", "text")


def test_the_servers_share_the_help_texts(capsys: pytest.CaptureFixture[str]) -> None:
    def help_text(parse: Callable[[list[str]], Any]) -> str:
        with pytest.raises(SystemExit):
            parse(["--help"])
        return " ".join(capsys.readouterr().out.split())

    for _, parse, _, _ in SERVERS:
        assert METRICS_LISTEN_HELP in help_text(parse)
    for parse in (engine_config.parse_args, store_config.parse_args):
        text = help_text(parse)
        for shared in (LISTEN_HELP, AUTH_FILE_HELP, INSECURE_NO_AUTH_HELP, "PEM private key"):
            assert shared in text
