"""Build ``data/warc/python_docs_sample.warc.gz`` from Debian's ``python3.11-doc`` package (PSF License v2).

The pages are real HTML, as shipped in the package; the WARC envelope is ours: each page becomes a ``request`` +
``response`` pair for its docs.python.org URL, as a crawler would have archived it (HTTP/1.1 200, text/html), with
deterministic record ids (uuid5 of the URL) and one fixed date, so the file is reproducible byte for byte. Three
records that a crawl always holds and that ingest must quarantine are added: robots.txt (text/plain), a 404 page and
a 301 redirect.

    apt-get download python3.11-doc && dpkg-deb -x python3.11-doc_*.deb /tmp/pydoc
    python data/warc/make_sample.py /tmp/pydoc/usr/share/doc/python3.11/html
"""
from __future__ import annotations

import io
import sys
import uuid
from pathlib import Path

from warcio.statusandheaders import StatusAndHeaders
from warcio.warcwriter import WARCWriter

PAGES = [f"tutorial/{p}.html" for p in (
    "appetite", "interpreter", "introduction", "controlflow", "datastructures", "modules", "inputoutput", "errors",
    "classes", "stdlib", "stdlib2", "venv", "whatnow", "interactive", "floatingpoint", "appendix")] + \
    [f"faq/{p}.html" for p in ("general", "programming", "design", "library", "extending", "windows", "gui",
                                "installed")] + \
    [f"howto/{p}.html" for p in ("annotations", "ipaddress", "sockets", "sorting", "pyporting", "curses",
                                 "urllib2", "unicode", "argparse", "logging", "regex", "descriptor", "functional",
                                 "enum")]
BASE = "https://docs.python.org/3.11/"
DATE = "2026-11-20T12:00:00Z"
OUT = Path(__file__).with_name("python_docs_sample.warc.gz")


def rid(url: str, kind: str) -> str:
    return f"<urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, kind + ':' + url)}>"


def write_pair(w: WARCWriter, url: str, status: str, ctype: str, body: bytes, extra: list | None = None) -> None:
    host = url.split("/")[2]
    req = StatusAndHeaders(f"GET /{url.split('/', 3)[3]} HTTP/1.1", [("Host", host), ("User-Agent", "llmp-sample")],
                           is_http_request=True)
    w.write_record(w.create_warc_record(url, "request", http_headers=req, warc_headers_dict={
        "WARC-Date": DATE, "WARC-Record-ID": rid(url, "request")}))
    http = StatusAndHeaders(status, [("Content-Type", ctype), ("Content-Length", str(len(body))), *(extra or [])],
                            protocol="HTTP/1.1")
    w.write_record(w.create_warc_record(url, "response", payload=io.BytesIO(body), http_headers=http,
                                        warc_headers_dict={"WARC-Date": DATE, "WARC-Record-ID": rid(url, "response")}))


def main(html_root: str) -> None:
    root = Path(html_root)
    with open(OUT, "wb") as f:
        w = WARCWriter(f, gzip=True)
        info = b"software: data/warc/make_sample.py (warcio 1.8.1)\r\ndescription: python3.11-doc 3.11.2, PSF-2.0\r\n"
        w.write_record(w.create_warc_record("", "warcinfo", payload=io.BytesIO(info),
                                            warc_content_type="application/warc-fields", warc_headers_dict={
                                                "WARC-Date": DATE, "WARC-Record-ID": rid(OUT.name, "warcinfo"),
                                                "WARC-Filename": OUT.name}))
        for page in PAGES:
            write_pair(w, BASE + page, "200 OK", "text/html; charset=utf-8", (root / page).read_bytes())
        write_pair(w, "https://docs.python.org/robots.txt", "200 OK", "text/plain",
                   b"User-agent: *\nDisallow: /2/\n")
        write_pair(w, BASE + "tutorial/missing.html", "404 Not Found", "text/html; charset=utf-8",
                   b"<html><head><title>404</title></head><body><h1>Not Found</h1></body></html>")
        write_pair(w, "https://docs.python.org/", "301 Moved Permanently", "text/html", b"",
                   [("Location", "https://docs.python.org/3/")])
    print(f"{OUT}: {OUT.stat().st_size:,} bytes, {len(PAGES)} pages + 3 non-document responses")


if __name__ == "__main__":
    main(sys.argv[1])
