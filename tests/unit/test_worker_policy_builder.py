"""The pool's worker NetworkPolicy as the operator builds it (rules/builders.py) and the flag that
carries its rules (--worker-policy-ingress, app/cli.py): bad input refused by name before anything
starts."""

from __future__ import annotations

import json
from typing import Any

import pytest
from warmpool_operator.activator import reach
from warmpool_operator.api.types import parse_spec
from warmpool_operator.app.cli import BadFlags, main, worker_policy_ingress
from warmpool_operator.model import Target
from warmpool_operator.rules import builders

from warmpool.contract.pods import ANNOTATION_SPEC_HASH, AWAKE_FALSE, LABEL_AWAKE

pytestmark = pytest.mark.unit

RULES: list[dict[str, Any]] = [{"ports": [{"port": "http", "protocol": "TCP"}], "from": [{"podSelector": {}}]}]


def target(namespace: str = "team-a") -> Target:
    return Target("llama", namespace, parse_spec({"model": {"hostPath": {"path": "/models/m"}}}))


def test_the_policy_selects_the_pools_pods_asleep_or_awake_and_carries_the_rules_given() -> None:
    policy = builders.build_network_policy(target(), RULES)
    assert (policy["kind"], policy["metadata"]["name"], policy["metadata"]["namespace"]) == (
        "NetworkPolicy", "llama-worker-policy", "team-a")
    assert policy["metadata"]["labels"] == builders.common_labels("llama")  # what the operator's watch selects
    assert ANNOTATION_SPEC_HASH in policy["metadata"]["annotations"]
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"] and spec["ingress"] == RULES
    assert spec["ingress"][0] is not RULES[0]  # a copy: kopf.adopt and the apply never touch the settings'
    awake = builders.pod_labels("llama")
    asleep = {**awake, LABEL_AWAKE: AWAKE_FALSE}
    for labels in (awake, asleep):
        assert reach.selector_matches(spec["podSelector"], labels)
    assert not reach.selector_matches(spec["podSelector"], builders.pod_labels("other-pool"))
    # Another rule set is another desired object: the spec hash moves, so the drift is written.
    other = builders.build_network_policy(target(), [{"ports": [{"port": "http", "protocol": "TCP"}]}])
    assert other["metadata"]["annotations"][ANNOTATION_SPEC_HASH] != policy["metadata"]["annotations"][
        ANNOTATION_SPEC_HASH]


def test_the_flag_parses_to_the_rules_and_unset_means_no_policy() -> None:
    assert worker_policy_ingress(None) is None
    assert worker_policy_ingress(json.dumps(RULES)) == tuple(RULES)
    assert worker_policy_ingress("[]") == ()  # an empty list: a policy that admits nobody


@pytest.mark.parametrize(("text", "says"), [
    ("{not json", "is not JSON"),
    ('{"from": []}', "must be a JSON list"),
    ('[{"form": []}]', "rule 0: an object with only 'from' and 'ports'"),
    ('[{"from": {}}]', "rule 0: 'from' must be a list of objects"),
    ('[{"ports": [80]}]', "rule 0: 'ports' must be a list of objects"),
])
def test_a_bad_flag_is_refused_naming_what_is_wrong(text: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(BadFlags, match="--worker-policy-ingress") as raised:
        worker_policy_ingress(text)
    assert says in str(raised.value)
    assert main(["--all-namespaces", "--worker-policy-ingress", text]) == 2
    assert "--worker-policy-ingress" in capsys.readouterr().err
