"""Sleep configuration and level parsing (#15): bad input is refused naming the flag or field."""

from __future__ import annotations

import pytest
from warmpool_worker.config import ConfigError, SidecarConfig, SleepConfig
from warmpool_worker.http_app import BadRequest
from warmpool_worker.sleep_request import parse_level

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("raw", [1, 2, "1", "2"])
def test_levels_accepted(raw: object) -> None:
    assert parse_level(raw) == int(str(raw))


@pytest.mark.parametrize("raw", [0, 3, True, None, "deep", 1.5, 1.0, "", [1],
                                 "\u00b2", "\u0661", "\uff11", "+1", "01x", "9" * 5000])
def test_bad_level_is_a_400_naming_level(raw: object) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_level(raw)
    assert caught.value.status == 400 and caught.value.param == "level" and "level" in caught.value.message


@pytest.mark.parametrize("timeout", [0, -1.0, True])
def test_wake_timeout_must_be_positive(timeout: float) -> None:
    with pytest.raises(ConfigError, match="--wake-timeout"):
        SleepConfig(wake_timeout_s=timeout)


def test_sidecar_sleep_api_is_one_of_the_known() -> None:
    assert SidecarConfig(engine_url="http://127.0.0.1:8000", engine_sleep_api="sglang").engine_sleep_api == "sglang"
    with pytest.raises(ConfigError, match="--engine-sleep-api"):
        SidecarConfig(engine_url="http://127.0.0.1:8000", engine_sleep_api="tgi")
