"""`warmpool operator`'s watch flags, refused before anything starts when they cannot work."""

from __future__ import annotations

import pytest
from warmpool_operator.app.cli import build_parser, main

pytestmark = pytest.mark.unit


def test_watch_timeouts_default_to_kopfs_own_reading_of_the_bookmark_interval() -> None:
    args = build_parser().parse_args(["--namespace", "ns"])
    assert args.watch_server_timeout == 120
    # Bookmarks come once a minute: a shorter inactivity bound would redial healthy quiet watches.
    assert args.watch_inactivity_timeout == 70.0
    assert args.resync_interval == 600.0


@pytest.mark.parametrize("flag", ["--watch-server-timeout", "--watch-inactivity-timeout", "--resync-interval"])
def test_a_watch_timeout_of_zero_is_refused(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--namespace", "ns", flag, "0"]) == 2
    err = capsys.readouterr().err
    assert flag in err and "must be positive" in err


def test_the_server_timeout_is_whole_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    # The API server parses a watch's timeoutSeconds as an integer: "10.0" is a 400 on every watch.
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--namespace", "ns", "--watch-server-timeout", "10.5"])
    assert "--watch-server-timeout" in capsys.readouterr().err
    assert build_parser().parse_args(["--namespace", "ns", "--watch-server-timeout", "10"]).watch_server_timeout == 10


def test_a_demand_step_shorter_than_three_scrapes_is_flagged_at_start() -> None:
    from warmpool_operator.app.cli import config_warnings

    assert config_warnings(10.0, 60) == []  # the defaults: six scrapes a step
    assert config_warnings(2.0, 10) == []
    (warning,) = config_warnings(10.0, 10)  # what the live predict bench first ran with
    assert "--predict-step-seconds 10" in warning and "--scrape-interval 10s" in warning
    assert "at least 30s" in warning


def test_the_control_keys_namespace_is_named_or_found(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from warmpool_operator.app.cli import config_from_args

    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    config = config_from_args(build_parser().parse_args(["--namespace", "team-a", "--namespace", "team-b"]))
    assert (config.control_key_namespace, config.control_key_secret) == ("team-a", "warmpool-control-key")
    named = ["-A", "--control-key-namespace", "ops", "--control-key-secret", "k"]
    config = config_from_args(build_parser().parse_args(named))
    assert (config.control_key_namespace, config.control_key_secret) == ("ops", "k")
    monkeypatch.setenv("POD_NAMESPACE", "warmpool-system")
    assert config_from_args(build_parser().parse_args(["-A"])).control_key_namespace == "warmpool-system"
    monkeypatch.delenv("POD_NAMESPACE")
    assert main(["-A"]) == 2  # cluster-wide outside a pod: where would the key live?
    assert "--control-key-namespace" in capsys.readouterr().err
