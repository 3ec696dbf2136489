"""`omni serve` says "serving on" once its models answer; its flags (the edge's dashboard
among them) and every other command's all have a help text; a taken dashboard port is
one warning line."""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import time

import click
import httpx

from edge import server as edge_server
from omni import cli, ctl
from omni.runtime import omnid
from tests.conftest import free_port, start_server, wait_until


def click_options(command: click.Command, path: str = ""):
    """(command path, option) for every option of `command` and its subcommands."""
    path = f"{path} {command.name}".strip()
    for param in command.params:
        if isinstance(param, click.Option):
            yield path, param
    for sub in getattr(command, "commands", {}).values():
        yield from click_options(sub, path)


def test_every_option_of_every_command_has_a_help_text():
    missing = [
        f"{path} {'/'.join(opt.opts)}"
        for main in (cli.main, ctl.main)
        for path, opt in click_options(main)
        if not opt.help
    ]
    for parser in (omnid.arg_parser(), edge_server.arg_parser()):
        missing += [
            f"{parser.prog} {'/'.join(a.option_strings)}"
            for a in parser._actions
            if not isinstance(a, argparse._HelpAction) and not a.help
        ]
    assert missing == []


def test_serving_on_comes_once_a_chat_request_is_answered_at_once(tmp_path, text_model_dir):
    """Printed when the models answer (before: as soon as the edge did, ~14 s before the
    default text model could), and with the edge's dashboard where --edge-dashboard says."""
    config = tmp_path / "omnid.toml"
    config.write_text(
        f'default_models = false\n[[models]]\nname = "chat"\npath = "{text_model_dir}"\n'
    )
    board = free_port()
    argv = ("--config", str(config), "--edge-dashboard", f"127.0.0.1:{board}")
    server = start_server(tmp_path, *argv)
    try:
        line = wait_until(
            lambda: next((x for x in server.log().splitlines() if "serving on" in x), None),
            180,
            "the serving line",
            interval_s=0.02,
        )
        assert server.instances()["chat"]["state"] == "ready", line
        t0 = time.monotonic()
        body = {"model": "chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        reply = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=10)
        took = time.monotonic() - t0
        assert reply.status_code == 200, reply.text
        assert took < 5, f"answered {took:.1f} s after '{line}'"
        assert line.startswith(f"omni: serving on {server.base_url}/v1 (models ready: chat;")
        log = server.log()
        assert log.index("omni: starting on") < log.index("omni: serving on")
        snap = httpx.get(f"http://127.0.0.1:{board}/v1/dashboard", timeout=10)
        assert snap.status_code == 200 and snap.json()["kind"] == "edge"
    finally:
        server.stop()


def test_a_bad_edge_dashboard_value_is_refused_before_anything_starts():
    done = subprocess.run(
        [sys.executable, "-m", "omni.cli", "serve", "--edge-dashboard", "dash.example:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "Invalid value for '--edge-dashboard'" in done.stderr
    assert "'dash.example' is not an IP address" in done.stderr


def edge_log(tmp_path, dashboard: str) -> str:
    """What an edge started with `--dashboard dashboard` logs until it serves."""
    port = free_port()
    log = tmp_path / f"edge-{port}.log"
    argv = ["--port", str(port), "--upstream", "http://127.0.0.1:9", "--dashboard", dashboard]
    proc = subprocess.Popen(
        [sys.executable, "-m", "edge.server", *argv], stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    try:
        wait_until(lambda: "omni-edge listening" in log.read_text(), 60, "the edge listening")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return log.read_text()


def test_a_taken_dashboard_port_is_one_warning_line_and_off_is_silent(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        text = edge_log(tmp_path, f"127.0.0.1:{port}")
    about = [line for line in text.splitlines() if "dashboard" in line]
    assert len(about) == 1, text
    assert re.search(r" WARNING [\w.]+: edge dashboard not served: cannot listen", about[0])
    assert f"127.0.0.1:{port}" in about[0] and "--dashboard HOST:PORT" in about[0]
    assert "ERROR" not in text and "Traceback" not in text
    assert "dashboard" not in edge_log(tmp_path, "off")
