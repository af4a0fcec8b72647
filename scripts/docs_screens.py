"""A full-page screenshot of every guide of the built site in headless Chromium, for a person to look at
(``make docs-screens``; not run by CI, which checks the same pages with ``scripts/check_site.py``).

    python scripts/docs_screens.py build/site --output build/screens

The site is served on 127.0.0.1 (a free port, this process only, stopped at the end). Chromium (Debian's
``chromium`` package; ``--chromium`` names another binary) is driven over its DevTools pipe, so each page is
captured whole, not just one window's height: ``index.png`` for the front page, ``guides-NAME.png`` for each guide.
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import functools
import http.server
import json
import os
import select
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

WIDTH = 1280  # CSS pixels: the width at which Material shows the navigation beside the page
PAGE_TIMEOUT = 60.0  # seconds for one page to load and be captured


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # one line per request would bury the script's own lines
        pass


def _high_fd(fd: int) -> int:
    """``fd`` moved to the lowest free descriptor >= 10 (the old one closed)."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved


class DevTools:
    """Chromium's DevTools protocol over ``--remote-debugging-pipe``: JSON messages ended by NUL, written to the
    child's fd 3 and read from its fd 4. Every wait has a deadline (``PAGE_TIMEOUT``): a page that never loads, or
    a browser that stops answering, is a ``TimeoutError``, not a hang."""

    def __init__(self, binary: str):
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        # the child's ends moved to fds >= 10, so that the shell's redirections onto 3 and 4 cannot overlap them
        to_child_r, from_child_w = (_high_fd(fd) for fd in (to_child_r, from_child_w))
        args = [binary, "--headless=new", "--remote-debugging-pipe", "--disable-gpu", "--hide-scrollbars",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions", "about:blank"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses to run its sandbox as root (a container's usual user)
        # The pipe ends reach the browser as fds 3 and 4 through a small exec shim (no preexec_fn, which is unsafe
        # beside threads; the ends sit at 10 and above, so that moving them onto 3 and 4 cannot overwrite one).
        shim = ("import os, sys; r, w = int(sys.argv[1]), int(sys.argv[2]); os.dup2(r, 3); os.dup2(w, 4); "
                "os.close(r); os.close(w); os.execvp(sys.argv[3], sys.argv[3:])")
        self.process = subprocess.Popen([sys.executable, "-c", shim, str(to_child_r), str(from_child_w), *args],
                                        pass_fds=(to_child_r, from_child_w), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        os.close(to_child_r)
        os.close(from_child_w)
        self._buffer = b""
        self._events = []  # events read while waiting for a reply, kept for wait_for
        self._next = 0

    def call(self, method: str, session: str = None, timeout: float = PAGE_TIMEOUT, **params) -> dict:
        self._next += 1
        message = {"id": self._next, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self.receive(deadline)
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error'].get('message')}")
                return reply.get("result", {})
            if "method" in reply:
                self._events.append(reply)

    def receive(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_child], [], [], left)[0]:
                raise TimeoutError("chromium did not answer in time")
            chunk = os.read(self._from_child, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed its DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def wait_for(self, event: str, session: str, deadline: float) -> None:
        while True:
            found = next((m for m in self._events if m.get("method") == event and m.get("sessionId") == session), None)
            if found is not None:
                self._events.remove(found)
                return
            message = self.receive(deadline)
            if "method" in message:
                self._events.append(message)

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except (OSError, RuntimeError, TimeoutError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._to_child)
        os.close(self._from_child)


def capture(devtools: DevTools, url: str, path: Path) -> tuple:
    """The whole page at ``url`` as a PNG at ``path``; returns its (width, height) in CSS pixels."""
    target = devtools.call("Target.createTarget", url="about:blank")["targetId"]
    session = devtools.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
    try:
        devtools.call("Page.enable", session)
        devtools.call("Emulation.setDeviceMetricsOverride", session, width=WIDTH, height=900, deviceScaleFactor=1,
                      mobile=False)
        navigated = devtools.call("Page.navigate", session, url=url)
        if navigated.get("errorText"):
            raise RuntimeError(f"{url}: {navigated['errorText']}")
        devtools.wait_for("Page.loadEventFired", session, time.monotonic() + PAGE_TIMEOUT)
        height = int(devtools.call("Page.getLayoutMetrics", session)["cssContentSize"]["height"])
        devtools.call("Emulation.setDeviceMetricsOverride", session, width=WIDTH, height=height,
                      deviceScaleFactor=1, mobile=False)
        shot = devtools.call("Page.captureScreenshot", session, format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return WIDTH, height
    finally:
        devtools.call("Target.closeTarget", targetId=target)


def pages(site: Path) -> list:
    """(name, path under the site) of the front page and every guide."""
    found = [("index", "index.html")] if (site / "index.html").is_file() else []
    found += [(f"guides-{page.parent.name}", page.relative_to(site).as_posix())
              for page in sorted((site / "guides").glob("*/index.html"))]
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", type=Path, nargs="?", default=Path("build/site"))
    parser.add_argument("--output", type=Path, default=Path("build/screens"))
    parser.add_argument("--chromium", default=None, help="the browser binary (default: chromium on PATH)")
    args = parser.parse_args(argv)
    binary = args.chromium or shutil.which("chromium") or shutil.which("chromium-browser")
    if not binary:
        print("docs_screens: no chromium on PATH (Debian: apt-get install chromium), or name one with --chromium")
        return 2
    listed = pages(args.site)
    if not listed:
        print(f"docs_screens: {args.site} has no built pages (make docs builds them)")
        return 2
    args.output.mkdir(parents=True, exist_ok=True)
    devtools = DevTools(binary)  # before the server's thread starts: a child started beside threads is not safe
    handler = functools.partial(_Quiet, directory=str(args.site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for name, page in listed:
            path = args.output / f"{name}.png"
            width, height = capture(devtools, f"http://127.0.0.1:{server.server_address[1]}/{page}", path)
            print(f"{path}  {width} x {height}")
    finally:
        devtools.close()
        server.shutdown()
        server.server_close()
    print(f"docs_screens: {len(listed)} pages in {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
