"""``switchyard replay`` refuses bad input with one clear line and exit 2, before reading the log
(issue 36): never a traceback, never exit 0 on nonsense. The log is a real ``.sylog`` export of
an empty log (every topic, one partition), so valid arguments run the whole command quickly."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from control_plane.replay.cli import replay_app
from common.log.catalog import Catalog
from common.log.reader import MemoryLogReader, export_log

PREFIX = "sy-replay-cli"


@pytest.fixture(scope="module")
def sylog(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("log") / "empty.sylog"
    topics = list(Catalog(PREFIX).all_topics())
    export_log(MemoryLogReader([], partitions={t: 1 for t in topics}), topics, path)
    return str(path)


def _run(*args: str):
    return CliRunner().invoke(replay_app, list(args), catch_exceptions=True)


def _refused(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


@pytest.mark.parametrize("args, says", [
    (["state", "--at", "99999999999999999999999"], "past the year 9999"),
    (["state", "--at", "t:99999999999:1"], "beyond Kafka's partition"),
    (["state", "--at", "0001-01-01"], "before 1970"),
    (["state", "--source", "/nonexistent/x.sylog"], "--source"),
    (["state", "--export", "/nonexistent/dir/x.json"], "--export"),
    (["state", "--export", "/tmp"], "--export"),
    (["verify", "--from", "end", "--to", "start"], "is after to"),
    (["verify", "--from", "1700000000000", "--to", "1600000000000"], "is after to"),
    (["state", "--block-size", "0"], "--block-size 0"),
    (["state", "--block-size", "-5"], "--block-size -5"),
    (["state", "--hash-algo", "md5"], "--hash-algo 'md5'"),
])
def test_bad_input_is_one_line_and_exit_2(sylog: str, args: list[str], says: str) -> None:
    source = [] if "--source" in args else ["--source", sylog]
    line = _refused(_run(*args, *source, "--prefix", PREFIX, "--no-progress"))
    assert says in line, line


def test_a_source_that_is_not_an_export_is_refused(tmp_path) -> None:
    junk = tmp_path / "junk.sylog"
    junk.write_bytes(b"not a log")
    assert "--source" in _refused(_run("state", "--source", str(junk), "--no-progress"))


def test_valid_arguments_run(sylog: str) -> None:
    r = _run("state", "--source", sylog, "--prefix", PREFIX, "--no-progress", "--block-size", "16")
    assert r.exit_code == 0, (r.output, r.exception)
    r = _run("verify", "--source", sylog, "--prefix", PREFIX, "--no-progress", "--from", "start", "--to", "end")
    assert r.exit_code == 0, (r.output, r.exception)


_points = st.one_of(st.sampled_from(["start", "end", "request:", "request:x", "{}", '{"a:0": -1}', "t:0:0", "1e9",
                                     "2026-13-01", "9999-12-31T23:59:59Z", "-1", ""]),
                    st.integers(-10**25, 10**25).map(str), st.text(max_size=30))
_options = st.one_of(
    st.tuples(st.just("--at"), _points), st.tuples(st.just("--block-size"), st.integers(-10**12, 10**12).map(str)),
    st.tuples(st.just("--block-size"), st.text(max_size=8)),
    st.tuples(st.just("--hash-algo"), st.one_of(st.sampled_from(["sha256", "xxhash", "md5", ""]), st.text(max_size=8))),
    st.tuples(st.just("--export"), st.sampled_from(["/nonexistent/x", "/", "", "/proc/version"])),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cmd=st.sampled_from(["state", "verify"]), opts=st.lists(_options, max_size=3),
       frm=_points, to=_points)
def test_fuzzed_arguments_never_crash(sylog: str, cmd: str, opts: list[tuple[str, str]], frm: str, to: str) -> None:
    """Whatever the arguments: exit 0 or 1 from a run, or 2 with one ``error:`` line (ours or
    typer's usage error); never an exception."""
    args = [cmd, "--source", sylog, "--prefix", PREFIX, "--no-progress"]
    if cmd == "state":
        args += [x for o in opts for x in o]
    else:
        args += ["--from", frm, "--to", to]
    r = _run(*args)
    assert r.exception is None or isinstance(r.exception, SystemExit), (args, repr(r.exception), r.output)
    assert r.exit_code in (0, 1, 2), (args, r.exit_code, r.output)
    if r.exit_code == 2 and "Usage:" not in r.output:
        assert [line for line in r.output.splitlines() if line.strip()][0].startswith("error: "), (args, r.output)
