#!/usr/bin/env python3
"""Serve dashboards/ui as the server does, proxying everything else to a running Apron.

    python3 tests/ui/dev_server.py --upstream http://127.0.0.1:9402 [--listen 127.0.0.1:8080]

For working on the web UI without rebuilding the binary: `/` is index.html, `/ui/<path>`
is dashboards/ui/<path> read from disk on every request (edit, reload), with the headers
server/src/ui.rs sends (Content-Security-Policy: default-src 'self', nosniff, no-cache);
every other path (/api/..., /metrics, /healthz) is forwarded to --upstream with its
method, body and the Accept / Authorization / Content-Type headers. Python stdlib only.
Prints "listening on http://HOST:PORT" once bound (port 0 picks a free one).
"""

import argparse
import http.server
import os
import sys
import urllib.error
import urllib.request

UI_DIR = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "dashboards", "ui"))

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".md": "text/plain; charset=utf-8",
}
FORWARD_HEADERS = ("Accept", "Authorization", "Content-Type")


class Handler(http.server.BaseHTTPRequestHandler):
    upstream = ""
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quieter than the default
        sys.stderr.write("dev_server: " + (fmt % args) + "\n")

    def _send(self, status, ctype, body, extra=()):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _asset(self, rel):
        path = os.path.normpath(os.path.join(UI_DIR, rel))
        if not path.startswith(UI_DIR + os.sep) or not os.path.isfile(path):
            body = b'{"error":"not_found","detail":"no UI asset ' + rel.encode("utf-8", "replace") + b'"}'
            return self._send(404, "application/json", body)
        ext = os.path.splitext(path)[1]
        ctype = CONTENT_TYPES.get(ext, "text/plain; charset=utf-8")
        with open(path, "rb") as f:
            body = f.read()
        self._send(
            200,
            ctype,
            body,
            (
                ("Cache-Control", "no-cache"),
                ("Content-Security-Policy", "default-src 'self'"),
                ("X-Content-Type-Options", "nosniff"),
            ),
        )

    def _proxy(self):
        length = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(length) if length else None
        req = urllib.request.Request(self.upstream + self.path, data=data, method=self.command)
        for h in FORWARD_HEADERS:
            if self.headers.get(h):
                req.add_header(h, self.headers[h])
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                status, ctype, body = r.status, r.headers.get("Content-Type", "application/octet-stream"), r.read()
        except urllib.error.HTTPError as e:
            status, ctype, body = e.code, e.headers.get("Content-Type", "application/json"), e.read()
        except OSError as e:
            status, ctype = 502, "application/json"
            body = ('{"error":"bad_gateway","detail":"%s"}' % str(e).replace('"', "'")).encode()
        self._send(status, ctype, body)

    def _route(self):
        path = self.path.split("?", 1)[0]
        if self.command in ("GET", "HEAD") and path == "/":
            return self._asset("index.html")
        if self.command in ("GET", "HEAD") and path.startswith("/ui/"):
            return self._asset(path[len("/ui/"):])
        return self._proxy()

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = _route


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", required=True, help="the Apron server, e.g. http://127.0.0.1:9402")
    ap.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0: a free one)")
    args = ap.parse_args()
    host, port = args.listen.rsplit(":", 1)
    Handler.upstream = args.upstream.rstrip("/")
    srv = http.server.ThreadingHTTPServer((host, int(port)), Handler)
    print("listening on http://%s:%d" % srv.server_address[:2], flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
