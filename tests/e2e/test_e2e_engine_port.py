"""A sleeping pool's external engine is out of reach of other pods, on the real node.

vLLM serves its sleep and cache endpoints without authentication in dev mode, which sleep needs.
So with spec.pool.sleep the operator starts the engine on the pod's loopback: only the sidecar
beside it reaches it, and the pool's traffic goes through the sidecar's port.  The engine here is
the project's own worker image serving vLLM's dev-mode sleep API (`--vllm-sleep-api`), so the
test needs no vLLM; another pod on the node then dials the engine's port and the sidecar's.

Only pod IPs on the real node's bridge are dialled; every wait is bounded.
"""

from __future__ import annotations

import json

import pytest

from tests.support.e2e import World, run_pod, tiny_model, warmmodel
from warmpool.contract.files import MODEL_MOUNT_PATH
from warmpool.contract.http import DEFAULT_WORKER_PORT, PATH_READYZ
from warmpool.contract.pods import ENGINE_CONTAINER, ENV_POD_IP

ENGINE_PORT = 8000

#: Run in another pod: one TCP connect to each port of the worker pod, and the sidecar's /readyz.
PROBE = """
import json, socket, sys, urllib.request
ip = sys.argv[1]
out = {}
for name, port in (("engine", int(sys.argv[2])), ("sidecar", int(sys.argv[3]))):
    try:
        socket.create_connection((ip, port), timeout=5).close()
        out[name] = "open"
    except OSError as error:
        out[name] = type(error).__name__
with urllib.request.urlopen(f"http://{ip}:{sys.argv[3]}/readyz", timeout=10) as response:
    out["readyz"] = response.status
print("PROBE " + json.dumps(out))
"""


@pytest.mark.e2e
@pytest.mark.timeout(480)
def test_a_sleeping_pools_engine_port_is_closed_to_other_pods(world: World) -> None:
    image = world.cluster.images.get("worker")
    if world.cluster.node is None or image is None:
        pytest.skip("needs the local cluster's real node and the worker image loaded there")
    model = tiny_model()
    wm = warmmodel("engine-port", model)
    wm["spec"]["engine"] = {
        "kind": "sidecar", "image": image, "port": ENGINE_PORT, "healthPath": PATH_READYZ,
        "args": ["serve", f"--model={MODEL_MOUNT_PATH}", f"--port={ENGINE_PORT}", "--device=cpu",
                 "--buckets=16", "--prompts-per-bucket=1", "--decode-tokens=1", "--vllm-sleep-api"],
        # Bind every address unless told otherwise, as vLLM does (the worker's own default is the
        # pod IP, else loopback): only the operator's --host keeps it on loopback.
        "env": [{"name": ENV_POD_IP, "value": "0.0.0.0"}],
    }
    wm["spec"]["pool"]["sleep"] = {"afterIdleSeconds": 3600}
    wm["spec"]["pod"]["workerArgs"] = ["--prompts-per-bucket=1", "--decode-tokens=1"]
    world.apply(wm)
    world.wait_ready("engine-port", warm=1, timeout=360)
    pod = world.pods("engine-port")[0]
    engine = next(c for c in pod["spec"]["containers"] if c["name"] == ENGINE_CONTAINER)
    assert "--host=127.0.0.1" in engine["args"] and "ports" not in engine, engine

    # Inside the pod the engine answers on loopback: the sidecar warmed it through there.
    url = f"http://127.0.0.1:{ENGINE_PORT}/is_sleeping"
    inside = world.kubectl("exec", pod["metadata"]["name"], "-c", ENGINE_CONTAINER, "--", "python3", "-c",
                           f"import urllib.request as u; print(u.urlopen({url!r}, timeout=10).read().decode())")
    assert json.loads(inside) == {"is_sleeping": False}

    ip = pod["status"]["podIP"]
    phase, log = run_pod(world.cluster, world.ns, "engine-port-probe", image,
                         ["python3", "-c", PROBE, ip, str(ENGINE_PORT), str(DEFAULT_WORKER_PORT)])
    assert phase == "Succeeded", log
    result = json.loads(log.split("PROBE ", 1)[1].splitlines()[0])
    assert result == {"engine": "ConnectionRefusedError", "sidecar": "open", "readyz": 200}, result
