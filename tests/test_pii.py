"""The PII step (pipelines.data.pii) on a labelled sample (tests/pii_sample.py: the method is there and in
docs/data.md) and on the shapes it must leave alone; the URL rules (pipelines.data.urlfilter)."""
import pytest

from pipelines.data import pii
from pipelines.data.urlfilter import UrlRules, host_of, read_list

from pii_sample import score


def test_precision_and_recall_on_the_labelled_sample():
    res = score(pii.find)
    for kind in ("email", "ipv4", "ipv6", "phone"):
        assert res[kind]["precision"] >= 0.95 and res[kind]["recall"] >= 0.9, (kind, res[kind])
    assert res["all"]["tp"] > 300


KEEP = ["2024-01-15", "15.01.2024", "01/15/2024", "v1.2.3.4", "version 10.0.19041.1", "Python 3.11.4", "$1,299.99",
        "€ 1.299,00", "Room 1204", "Suite 300", "12:30:45", "ISBN 978-3-16-148410-0", "Order #1234567890",
        "pages 1 2 3 4 5 6 7 8 9 10 11 12", "40.7128, -74.0060"]


@pytest.mark.parametrize("text", KEEP)
def test_dates_versions_prices_and_room_numbers_are_left_as_they_are(text):
    assert pii.scrub(f"On {text} we met.") == (f"On {text} we met.", {})


def test_every_kind_is_replaced_by_its_placeholder_and_counted():
    text = ("Mail jane.doe@example.org or J.Smith+news@mail.co.uk, call +1 (415) 555-2671 or 020 7946 0958; "
            "host 203.0.113.45 and 2001:db8:85a3::8a2e:370:7334. Room 1204, 2024-01-15, $1,299.99.")
    out, counts = pii.scrub(text)
    assert counts == {"email": 2, "phone": 2, "ipv4": 1, "ipv6": 1}
    for original in ("jane.doe", "J.Smith", "555-2671", "7946", "203.0.113.45", "8a2e"):
        assert original not in out
    assert out.count(pii.PLACEHOLDERS["email"]) == 2 and pii.PLACEHOLDERS["ipv6"] in out
    assert "Room 1204, 2024-01-15, $1,299.99." in out


def test_url_rules_block_by_domain_suffix_and_banned_word_and_the_allow_list_wins(tmp_path):
    rules = UrlRules(True, frozenset({"blocked.example", "bad.test"}), frozenset({"porn"}),
                     frozenset({"ok.bad.test"}))
    assert rules.check("https://www.blocked.example/a") == ("url:blocklist", False)
    assert rules.check("http://sub.bad.test/") == ("url:blocklist", False)
    assert rules.check("https://ok.bad.test/page") == (None, True)  # allowed over the block list
    assert rules.check("https://notblocked.example/a") == (None, False)  # a suffix of a label is not a domain
    assert rules.check("https://videos.example.com/free-porn/1") == ("url:banned_word", False)
    assert rules.check("https://example.com/pornography-laws") == (None, False)  # a word, not a substring
    for hidden in ("https://example.com/free-%70orn/1", "https://example.com/free-%2570orn", "https://example.com/?q=p%6Frn",
                   "https://example.com/?q=free+porn", "https://www.blocked%2Eexample/a", "https://www.%42locked.example/",
                   "https://%20/free-porn", "https://%2e/porn"):
        assert rules.check(hidden)[0] in ("url:banned_word", "url:blocklist"), hidden  # %-escapes decoded first
    assert rules.check(None) == (None, False) and rules.check("not a url") == (None, False)
    assert rules.check("http://[::1") == (None, False) and host_of("http://[::1") is None  # malformed: no host
    f = tmp_path / "list.txt"
    f.write_text("# UT1 style\nExample.COM\n\n.spam.test  # a comment\n")
    assert read_list(f) == {"example.com", "spam.test"}
