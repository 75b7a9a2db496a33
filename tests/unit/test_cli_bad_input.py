"""Bad input a new user tried across the commands (issue 22), checked without a cluster: each is one line
and exit code 2 before anything is touched, and the help shows what the user needs to choose well."""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpupool_sched.cli as gpupool_cli
from tests.support.cli_run import run

ROOT = Path(__file__).resolve().parents[2]


def one_line(argv: list[str], *words: str) -> str:
    code, _, err = run(argv)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """Connecting to a cluster fails the test: these inputs must be refused before."""
    from gpupool_devcluster.client import ClusterClient

    def connect(*args: object, **kwargs: object) -> None:
        raise AssertionError("connected to the cluster before the input was checked")

    monkeypatch.setattr(ClusterClient, "connect", connect)


# -- item 3: dev tools with limits -----------------------------------------------------------------

@pytest.mark.parametrize(("argv", "words"), [
    (["add-nodes", "--profile", "dgx-h100", "--count", "100000000", "--no-wait"],
     ["--count must be at most 5000 per call", "not 100000000"]),
    (["add-nodes", "--profile", "dgx-h100", "--count", "5001"], ["--count must be at most 5000"]),
    (["add-nodes", "--profile", "dgx-h100", "--count", "10", "--concurrency", "0"],
     ["--concurrency must be in 1..256"]),
    (["add-nodes", "--profile", "dgx-h100", "--count", "10", "--concurrency", "100000"],
     ["--concurrency must be in 1..256"]),
    (["delete-nodes", "--prefix", ""], ["--prefix '' would delete every fake node", "--all"]),
    (["delete-nodes", "--prefix", "x", "--all"], ["not allowed with argument"]),
    (["delete-nodes"], ["one of the arguments --prefix --all is required"]),
    (["delete-nodes", "--all", "--concurrency", "-1"], ["--concurrency must be in 1..256"]),
])
def test_dev_cluster_bounds_are_checked_first(no_cluster, argv: list[str], words: list[str]) -> None:
    one_line(["dev-cluster", *argv, "--name", "never-started"], *words)


@settings(max_examples=50, deadline=None)
@given(count=st.integers(min_value=5001, max_value=10**30))
def test_any_count_over_the_cap_is_refused_before_connecting(count: int) -> None:
    from gpupool_devcluster.client import ClusterClient

    real = ClusterClient.connect
    ClusterClient.connect = None  # type: ignore[assignment,method-assign]  # any use fails
    try:
        one_line(["dev-cluster", "add-nodes", "--profile", "dgx-h100", "--count", str(count)], "at most 5000")
    finally:
        ClusterClient.connect = real  # type: ignore[method-assign]


def test_the_cap_is_in_the_help() -> None:
    code, out, _ = run(["dev-cluster", "add-nodes", "--help"])
    text = " ".join(out.split())
    assert code == 0 and "1..5000 per call" in text and "without waiting for kwok to make them Ready" in text
    code, out, _ = run(["dev-cluster", "delete-nodes", "--help"])
    assert code == 0 and "--all" in out


# -- item 4: help shows defaults; one meaning for --metrics-port 0; log levels in any case -------------

def all_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every parser a user meets: each `gpupool` (sub-)sub-command and `gpupool-deviceplugin`."""
    from gpupool_deviceplugin.cli import build_parser as plugin_parser

    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser) -> None:
        found[parser.prog] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    walk(child)

    walk(gpupool_cli.build_parser())
    found["gpupool-deviceplugin"] = plugin_parser()
    return found


PARSERS = all_parsers()


def option_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The option's entry of --help as printed (on one line), default included."""
    formatter = parser.formatter_class(prog=parser.prog, width=10_000)  # type: ignore[call-arg]
    return " ".join(formatter._format_action(action).split())


def option(prog: str, flag: str) -> argparse.Action:
    (action,) = [a for a in PARSERS[prog]._actions if flag in a.option_strings]
    return action


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_every_option_has_help_and_shows_its_default(prog: str) -> None:
    """`scheduler`, `extender` and `status` hid their defaults, and --lease-duration, --renew-deadline and
    --retry-period had no help at all."""
    parser = PARSERS[prog]
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        assert action.help, f"{prog} {action.option_strings[0]} has no help"
        default = action.default
        if default is None or default is False or default == [] or default is argparse.SUPPRESS:
            continue
        shown = option_help(parser, action)
        assert f"default: {default})" in shown or "default" in action.help.lower(), (
            f"{prog} {action.option_strings[0]} hides its default {default!r}: {shown}")


@pytest.mark.parametrize(("prog", "flag", "default"), [
    ("gpupool scheduler", "--scheduler-name", "gpupool"),
    ("gpupool scheduler", "--metrics-port", "10251"),
    ("gpupool scheduler", "--metrics-address", "127.0.0.1"),
    ("gpupool scheduler", "--lease-namespace", "kube-system"),
    ("gpupool scheduler", "--lease-duration", "15.0"),
    ("gpupool scheduler", "--renew-deadline", "10.0"),
    ("gpupool scheduler", "--retry-period", "2.0"),
    ("gpupool extender", "--address", "127.0.0.1"),
    ("gpupool extender", "--metrics-port", "0"),
    ("gpupool status", "--scheduler-name", "gpupool"),
    ("gpupool simulate", "--ratio", "1.3"),
])
def test_the_defaults_the_issue_names_are_shown(prog: str, flag: str, default: str) -> None:
    assert option_help(PARSERS[prog], option(prog, flag)).endswith(f"(default: {default})")


@pytest.mark.parametrize("prog", ["gpupool scheduler", "gpupool extender", "gpupool-deviceplugin"])
def test_metrics_port_0_means_off_everywhere(prog: str) -> None:
    action = option(prog, "--metrics-port")
    assert "0: off" in (action.help or ""), action.help
    assert "free port" not in (action.help or "") and "only on" not in (action.help or "")


def test_the_ratio_help_gives_its_range() -> None:
    assert option_help(PARSERS["gpupool simulate"], option("gpupool simulate", "--ratio")).endswith(
        "in (0, 10] (default: 1.3)")


@pytest.mark.parametrize("level", ["debug", "DEBUG", "Warning", "error", "CRITICAL"])
def test_log_level_in_any_case(level: str) -> None:
    args = gpupool_cli.parse(gpupool_cli.build_parser(), ["scheduler", "--log-level", level])
    assert args.log_level == level.lower()
    args = gpupool_cli.parse(gpupool_cli.build_parser(), ["extender", "--port", "1", "--log-level", level])
    assert args.log_level == level.lower()
    from gpupool_deviceplugin.cli import build_parser as plugin_parser
    from gpupool_deviceplugin.cli import check_inputs

    plugin = plugin_parser().parse_args(["--log-level", level, "--kubelet-dir", "/"])
    assert check_inputs(plugin) is None


def test_an_unknown_flag_names_the_sub_command() -> None:
    one_line(["simulate", "--frobnicate"], "gpupool simulate: error: unrecognized arguments: --frobnicate")
    one_line(["status", "--frobnicate"], "gpupool status: error: unrecognized arguments: --frobnicate")
    one_line(["dev-cluster", "status", "--frob"], "gpupool dev-cluster status: error: unrecognized arguments")


def plugin(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpupool_deviceplugin.cli", *argv], capture_output=True,
                          text=True, timeout=60)


def test_the_device_plugin_has_a_version_and_lists_its_profiles() -> None:
    from importlib import metadata

    from gpupool_deviceplugin.nvml.profile import profile_names

    done = plugin("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"gpupool-deviceplugin {metadata.version('gpupool')}"
    assert f"shipped profile ({', '.join(profile_names())})" in option_help(
        PARSERS["gpupool-deviceplugin"], option("gpupool-deviceplugin", "--fake-nvml"))
    bad = plugin("--frobnicate")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "gpupool-deviceplugin: error: unrecognized arguments: --frobnicate (see gpupool-deviceplugin --help)"]


def test_readme_and_simulate_help_agree_on_the_default_policy() -> None:
    action = option("gpupool simulate", "--policy")
    assert action.default == "all" and "'all' (default)" in (action.help or "")
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "(ours, the default)" not in readme
    assert "`gpupool simulate` replays all seven unless `--policy` names some" in readme


def test_a_non_utf8_file_is_named_with_its_line(tmp_path: Path) -> None:
    from gpupool_deviceplugin.config import ConfigError, read_yaml
    from gpupool_sched.simulate.trace import TraceError, read_nodes

    (tmp_path / "n.csv").write_bytes(b"sn,cpu_milli,memory_mib,gpu,model\nn0,1,1,1,T\xff4\n")
    with pytest.raises(TraceError, match=r"n.csv: not UTF-8 text at line 2, column 11: byte 0xff; expected a CSV"):
        read_nodes(tmp_path / "n.csv")
    (tmp_path / "c.yaml").write_bytes(b"metrics:\n  port: \x81\n")
    with pytest.raises(ConfigError, match=r"c.yaml is not UTF-8 text at line 2, column 9: byte 0x81"):
        read_yaml(tmp_path / "c.yaml", "config file")


# -- fuzz: any tokens after any sub-command parse or give one line naming that sub-command -------------

LEAVES = sorted(p for p, parser in PARSERS.items() if p.startswith("gpupool ") and not any(
    isinstance(a, argparse._SubParsersAction) for a in parser._actions))
TOKENS = st.one_of(st.sampled_from(["--frobnicate", "-x", "--", "-", "0", "-1", "70000", "1e309", "nan", "DEBUG",
                                    "verbose", "", " ", "\x00", "é", "--log-level", "--metrics-port", "--count",
                                    "--prefix", "--all", "--ratio", "--policy", "--help=x", "--version"]),
                   st.text(max_size=6))


@settings(max_examples=300, deadline=None)
@given(prog=st.sampled_from(LEAVES), tokens=st.lists(TOKENS, max_size=5))
def test_random_tokens_parse_or_give_one_line_naming_the_command(prog: str, tokens: list[str]) -> None:
    """Parsing only (nothing runs): an exit is 0 (help) or 2 with one line from the innermost command."""
    argv = [*prog.split()[1:], *tokens]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            gpupool_cli.parse(gpupool_cli.build_parser(), argv)
        except SystemExit as exc:
            code = exc.code
        else:
            return
    if code == 0:
        return
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1, (argv, err.getvalue())
    assert lines[0].startswith("gpupool"), lines
    if any(t.startswith("--frob") for t in tokens) and "unrecognized" in lines[0]:
        assert lines[0].startswith(f"{prog}: error: "), (argv, lines)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(TOKENS, max_size=5), env_level=st.one_of(st.none(), st.sampled_from(["info", "LOUD", "Debug"])))
def test_random_plugin_command_lines_give_one_line(tokens: list[str], env_level: str | None) -> None:
    """gpupool-deviceplugin's parser and its own checks: one line and exit 2, or a command line to run."""
    import os

    from gpupool_deviceplugin.cli import build_parser as plugin_parser
    from gpupool_deviceplugin.cli import check_inputs

    old = os.environ.get("LOG_LEVEL")
    if env_level is None:
        os.environ.pop("LOG_LEVEL", None)
    else:
        os.environ["LOG_LEVEL"] = env_level
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                args = plugin_parser().parse_args([*tokens, "--kubelet-dir", "/"])
            except SystemExit as exc:
                lines = err.getvalue().strip().splitlines()
                assert exc.code == 0 or (exc.code == 2 and len(lines) == 1), err.getvalue()
                return
        problem = check_inputs(args)
        assert problem is None or "\n" not in problem
    finally:
        if old is None:
            os.environ.pop("LOG_LEVEL", None)
        else:
            os.environ["LOG_LEVEL"] = old
