"""`elastictrain dashboard` rendered by a real headless browser (Debian's `chromium`) against a real etcd.

Skipped, saying why, where no chromium is installed (CI: `apt-get install -y chromium`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import urllib.request

import pytest

from elastictrain.agent.status import EtcdStatusPublisher
from elastictrain.cli.dashboard import Sampler, make_server
from elastictrain.cli.target import JobConnection
from elastictrain.rendezvous.client import EtcdClient
from elastictrain.rendezvous.settings import EtcdSettings

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = pytest.mark.slow


@pytest.fixture
def dashboard(etcd, run_id):
    settings = EtcdSettings.from_conf(etcd.endpoint, run_id, {})
    client = EtcdClient(settings)
    client.connect()
    for name, rank, step in (("node-a", 0, 120), ("node-b", 1, 119)):
        pub = EtcdStatusPublisher(client, settings.run_prefix, name, max_restarts=3)
        pub.status.step = step
        pub.on_event("join", {"group_rank": rank, "world_size": 2})
        pub.flush()
    for step in (10, 20, 30):  # what rank 0 reports every 5 s
        pub.on_event("progress", {"step": step, "loss": 5.0 - step / 10, "step_time_s": 0.25, "tokens": 4096})
    pub.flush()
    pub.on_event("failure", {"cause": "rank 1: Signal 9 (SIGKILL)"})
    pub.flush()
    sampler = Sampler(JobConnection(client, settings), interval_s=0.2).start()
    server = make_server(sampler, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        server.server_close()
        sampler.close()
        client.delete_prefix(settings.run_prefix)
        client.close()


def test_json_endpoint_serves_the_status_view_and_history(dashboard):
    data = json.loads(urllib.request.urlopen(dashboard + "api/status", timeout=5).read())
    assert data["error"] == "" and data["view"]["state"] == "recovering"
    assert [m["node"] for m in data["view"]["members"]] == ["node-a", "node-b"]
    assert data["history"][-1]["steps"] == {"node-a": 120, "node-b": 119}
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(dashboard + "nope", timeout=5)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH; install it with `apt-get install -y chromium`")
def test_page_renders_members_events_and_the_step_chart_in_a_headless_browser(dashboard, tmp_path):
    r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                        f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000", "--dump-dom",
                        dashboard], capture_output=True, text=True, timeout=90)
    dom = r.stdout
    assert 'data-rendered="' in dom, f"the page's script never rendered:\n{dom[:2000]}\n{r.stderr[-2000:]}"
    assert "RECOVERING" in dom
    assert "<td>node-a</td>" in dom and "<td>node-b</td>" in dom and "<td>recovering</td>" in dom
    assert "rank 1: Signal 9 (SIGKILL)" in dom
    assert dom.count('class="series"') == 2  # one step line per node
    assert 'data-series="loss"' in dom and 'data-series="tokens_per_s"' in dom
    assert "ETTR " in dom and "time lost to faults: " in dom
    assert 'data-bucket="restarting"' in dom  # the job is recovering from the failure: the bar says so
