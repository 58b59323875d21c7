"""The status page in a real browser: headless Chromium watches a graph run.

A LocalCluster of two worker processes (with its token, so the page is opened by the
dashboard link, as a user would) serves the page; Chromium (Debian's ``chromium``) opens
it and is driven through its own DevTools protocol over a websocket (tornado's client:
no Playwright, no browser download). A graph runs while the test reads the page's own
DOM every 100 ms: the progress bars must show the graph part done, then all of it done;
the task stream must have drawn tasks and the workers' table must list both workers.
A screenshot goes to the test's tmp dir (and to ``$DCORE_SCREENSHOT`` if set: that is
how docs/images/status-page.png was made).

``ci/test.sh`` installs Chromium (root with apt-get) and then sets
``DCORE_REQUIRE_BROWSER=1``, which turns a missing browser into a failure instead of a
skip.
"""
import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import cloudpickle
import pytest
from tornado.websocket import websocket_connect

from distributed_server import Client, LocalCluster

pytestmark = pytest.mark.timeout(180)
# The worker processes cannot import this module: its task functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_browser() -> str:
    """The Chromium executable ($DCORE_CHROMIUM, else the first on PATH), or skip."""
    path = os.environ.get("DCORE_CHROMIUM") or next(
        (found for name in BROWSERS if (found := shutil.which(name))), None)
    if path is None:
        reason = ("no Chromium on this machine (apt-get install chromium, or set "
                  "DCORE_CHROMIUM): the status page was not tested in a browser")
        if os.environ.get("DCORE_REQUIRE_BROWSER") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return path


class Chromium:
    """Headless Chromium, one page, driven over the DevTools protocol (synchronous)."""

    def __init__(self, executable: str, profile_dir) -> None:
        self.proc = subprocess.Popen(
            [executable, "--headless=new", "--no-sandbox", "--disable-gpu",
             "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
             "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
             f"--user-data-dir={profile_dir}", "--window-size=1280,1000", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, start_new_session=True)  # its helpers die with it (killpg)
        self.stderr: list = []
        try:
            endpoint = self._devtools_endpoint(timeout=30)
        except BaseException:
            self._stop_browser()
            raise
        self.loop = asyncio.new_event_loop()
        self.ids = iter(range(1, 10**9))

        async def connect():
            return await websocket_connect(endpoint, max_message_size=256 * 2**20)

        self.ws = self._run(connect())
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target,
                                 flatten=True)["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=1280,
                  height=1000, deviceScaleFactor=1, mobile=False)

    def _devtools_endpoint(self, timeout: float) -> str:
        found: list = []

        def read():
            for line in self.proc.stderr:
                self.stderr.append(line)
                if "DevTools listening on " in line and not found:
                    found.append(line.split("DevTools listening on ", 1)[1].strip())

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not found:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("Chromium did not start: " + "".join(self.stderr[-20:]))
            time.sleep(0.05)
        return found[0]

    def _run(self, coro, timeout: float = 30):
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def call(self, method: str, session: bool = False, **params):
        """Send one command; return its result (events in between are dropped)."""
        msg_id = next(self.ids)
        msg = {"id": msg_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session

        async def exchange():
            await self.ws.write_message(json.dumps(msg))
            while True:
                text = await self.ws.read_message()
                if text is None:
                    raise RuntimeError("the DevTools connection closed")
                reply = json.loads(text)
                if reply.get("id") == msg_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply["result"]

        return self._run(exchange())

    def goto(self, url: str) -> None:
        """Open ``url`` and wait until its document has loaded."""
        self.call("Page.navigate", session=True, url=url)
        deadline = time.monotonic() + 30
        while self.evaluate("document.readyState") != "complete":
            assert time.monotonic() < deadline, "the page did not load"
            time.sleep(0.05)

    def evaluate(self, expression: str):
        """The JSON value of a JavaScript expression in the page."""
        result = self.call("Runtime.evaluate", session=True, expression=expression,
                           returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path) -> bytes:
        """A PNG of the whole page, written to ``path``."""
        height = self.evaluate("Math.ceil(document.body.getBoundingClientRect().bottom)")
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=1280,
                  height=int(min(max(height + 16, 400), 3000)), deviceScaleFactor=1,
                  mobile=False)
        data = base64.b64decode(self.call("Page.captureScreenshot", session=True,
                                          format="png")["data"])
        with open(path, "wb") as f:
            f.write(data)
        return data

    def close(self) -> None:
        async def close_ws():
            self.ws.close()  # on its own loop: it writes a close frame

        try:
            self._run(close_ws())
        finally:
            self.loop.close()
            self._stop_browser()

    def _stop_browser(self) -> None:
        """Stop Chromium and every helper process it started (its process group)."""
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):  # helpers that outlived the parent
            os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture
def browser(tmp_path):
    chromium = Chromium(find_browser(), tmp_path / "profile")
    yield chromium
    chromium.close()


def slow_square(x):
    time.sleep(0.01)
    return x * x


def flaky(x):
    if x % 50 == 7:
        raise ValueError(f"{x} is unlucky")
    time.sleep(0.01)
    return x


PAGE_STATE = """(() => {
  const p = document.getElementById("progress");
  const bars = [...document.querySelectorAll("#progress .bar")].map(b => ({
    prefix: b.dataset.prefix, total: +b.dataset.total, memory: +b.dataset.memory,
    erred: +b.dataset.erred}));
  return {polls: +(document.body.dataset.polls || 0), total: +p.dataset.total,
          done: +p.dataset.done, bars,
          workers: document.querySelectorAll("#workers tbody tr").length,
          drawn: +(document.getElementById("stream").dataset.shown || 0),
          connected: document.getElementById("connection").className};
})()"""


def test_status_page_shows_a_graph_run_to_completion(browser, tmp_path):
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address="127.0.0.1:0",
                      memory_limit=0) as cluster, Client(cluster) as client:
        link = cluster.dashboard_link
        assert "?token=" in link  # the cluster has a token: the link carries the page's
        browser.goto(link)
        assert browser.evaluate("location.search") == ""  # the token left the address bar
        deadline = time.monotonic() + 20
        while browser.evaluate(PAGE_STATE)["polls"] < 1:
            assert time.monotonic() < deadline, "the page never read the status"
            time.sleep(0.1)

        squares = client.map(slow_square, range(400))
        total = client.submit(sum, squares)
        erred = client.map(flaky, range(100))
        seen = []
        running_shot = None
        deadline = time.monotonic() + 90
        while True:
            state = browser.evaluate(PAGE_STATE)
            seen.append(state)
            if running_shot is None and state["drawn"] and \
                    0.3 * state["total"] < state["done"] < 0.8 * state["total"]:
                running_shot = browser.screenshot(tmp_path / "status-page-running.png")
            if total.done() and all(f.done() for f in erred) and state["total"] == 501 \
                    and state["done"] == 501:
                break
            assert time.monotonic() < deadline, f"the page never showed the end: {state}"
            time.sleep(0.1)
        assert total.result() == sum(x * x for x in range(400))

        final = seen[-1]
        partial = [s for s in seen if 0 < s["done"] < s["total"]]
        assert partial, "the page never showed the graph part done"
        assert final["connected"] == "dot ok"
        assert final["workers"] == 2
        assert final["drawn"] > 0, "the task stream drew nothing"
        bars = {bar["prefix"]: bar for bar in final["bars"]}
        assert bars["slow_square"] == {"prefix": "slow_square", "total": 400, "memory": 400,
                                       "erred": 0}
        assert bars["flaky"]["erred"] == 2 and bars["flaky"]["memory"] == 98
        assert bars["sum"]["memory"] == 1
        text = browser.evaluate("document.body.innerText")
        assert "400 / 400 in memory" in text and "2 erred" in text

        png = browser.screenshot(tmp_path / "status-page.png")
        assert png.startswith(b"\x89PNG") and len(png) > 10_000
        if os.environ.get("DCORE_SCREENSHOT"):  # docs/images/: mid-run if we caught one
            name = "status-page-running.png" if running_shot else "status-page.png"
            shutil.copyfile(tmp_path / name, os.environ["DCORE_SCREENSHOT"])
