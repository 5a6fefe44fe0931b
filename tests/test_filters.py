"""Each filter step on crafted and real examples (pure Python; the Spark stage is in test_data_spark)."""
import gzip
import json

from pipelines.data import quality as F
from pipelines.spec import FilterCfg, load_spec

from conftest import BUNDLED, SHARED, c4_docs

CFG = FilterCfg()
PROSE = ("The committee met on Tuesday to discuss the budget and the plans that have been made for the new "
         "library. Members of the public were invited to share their views with the board, and many of them "
         "spoke about the need for longer opening hours and more space for children to read and study. "
         "The chair thanked everyone for coming and said that the final decision would be made next month. "
         "A second meeting is planned for the spring, when the architects will present their drawings. "
         "Everyone agreed that the town needs a place where people of all ages can meet and learn.")


def only(step: str) -> FilterCfg:
    return load_spec(None, [f"data.filters.steps=[{step}]"], env={}).data.filters


def test_clean_prose_passes_every_step():
    reason, doc = F.apply_filters(PROSE, CFG)
    assert reason is None and doc.info["language"] == "en" and doc.info["language_score"] > 0.9


def test_language_step_records_language_and_rejects_others():
    fr = ("Le conseil municipal s'est réuni mardi pour discuter du budget et des projets de la nouvelle "
          "bibliothèque. Les habitants ont été invités à donner leur avis sur les horaires d'ouverture.")
    reason, doc = F.apply_filters(fr, only("language"))
    assert reason == "language" and doc.info["language"] == "fr"
    keep_fr = load_spec(None, ["data.filters.steps=[language]", "data.filters.language.languages=[en, fr]"],
                        env={}).data.filters
    assert F.filter_reason(fr, keep_fr) is None


def test_gopher_quality_rules():
    g = only("gopher_quality")
    assert F.filter_reason("too short to be a document", g) == "gopher_quality.word_count"
    assert F.filter_reason(" ".join(["supercalifragilisticexpialidocious"] * 60), g) == "gopher_quality.mean_word_len"
    assert F.filter_reason(PROSE + " #tag" * 20, g) == "gopher_quality.symbol_ratio"
    bullets = "\n".join(f"• remember the important information about registration {i}" for i in range(60))
    assert F.filter_reason(bullets, g) == "gopher_quality.bullet_lines"
    ell = "\n".join(f"read more about the story and the people of the town {i}..." for i in range(20))
    assert F.filter_reason(ell, g) == "gopher_quality.ellipsis_lines"
    assert F.filter_reason(" ".join(str(1000 + i) for i in range(200)) + " the and of", g) == "gopher_quality.alpha_words"
    assert F.filter_reason(" ".join(["lorem ipsum dolor sit amet consectetur"] * 10), g) == "gopher_quality.stop_words"


def test_gopher_repetition_rules():
    g = only("gopher_repetition")
    assert F.filter_reason("\n".join(["the cat sat on the mat"] * 10 + [PROSE]), g) == "gopher_repetition.dup_line_ratio"
    para = "This paragraph is repeated many times over in the page body text here."
    assert F.filter_reason("\n\n".join([para] * 3 + [PROSE] * 1), g).startswith("gopher_repetition.dup_")
    assert F.filter_reason(PROSE + " buy now" * 80, g) == "gopher_repetition.top_2gram"
    assert F.filter_reason(PROSE + " " + PROSE, g).startswith("gopher_repetition.dup_")  # whole text twice
    assert F.filter_reason(PROSE, g) is None


def test_c4_drops_bad_lines_and_removes_bad_docs():
    g = only("c4")
    page = ("Home | About | Contact\n" + PROSE.replace(". ", ".\n") +
            "\nPlease enable JavaScript to view the comments.\nThis site uses cookies to improve your experience.\n"
            "Share this")
    reason, doc = F.apply_filters(page, g)
    assert reason is None
    assert "Home | About" not in doc.text and "JavaScript" not in doc.text and "cookies" not in doc.text
    assert "Share this" not in doc.text and doc.info["c4_lines_dropped"] == 4
    assert F.filter_reason(PROSE + "\nLorem ipsum dolor sit amet, consectetur adipiscing elit.", g) == "c4.lorem_ipsum"
    assert F.filter_reason(PROSE + "\nWrite {name} in the template to insert the value.", g) == "c4.curly_bracket"
    assert F.filter_reason("One sentence only here.\nAnd a second one now.", g) == "c4.too_few_sentences"


def test_fineweb_rules():
    g = only("fineweb")
    assert F.filter_reason("\n".join(f"menu item number {i} without any stop" for i in range(20)), g) \
        == "fineweb.line_punct_ratio"
    assert F.filter_reason("\n".join(["Short line."] * 3 + [f"Item {i}." for i in range(10)]), g) \
        == "fineweb.short_line_ratio"
    assert F.filter_reason(PROSE + "\n" + "A repeated closing line that is here.\n" * 2, g) == "fineweb.char_dup_ratio"
    assert F.filter_reason(PROSE, g) is None


def test_real_docs_from_the_shared_corpora():
    docs = c4_docs(300)
    reasons = [F.filter_reason(d["text"], CFG) for d in docs]
    kept = sum(r is None for r in reasons)
    assert 0.6 * len(docs) < kept < len(docs)  # C4 was filtered once already: most survive
    assert {r.split(".")[0] for r in reasons if r} <= set(F.STEPS)
    p = SHARED / "corpus" / "cc_wet_2019_30_sample.jsonl.gz"
    p = p if p.exists() else BUNDLED / "cc_wet_2019_30_sample.jsonl.gz"
    raw = [json.loads(l)["text"] for l in gzip.open(p)]
    out = [F.apply_filters(t, CFG) for t in raw if t.strip()]
    langs = {d.info.get("language") for _, d in out}
    assert len(langs) >= 10  # the raw crawl really is multilingual
    assert sum(r is None for r, _ in out) < 0.5 * len(out)  # raw web text: most of it goes
    assert sum(r == "language" for r, _ in out) > 100


# ----------------------------------------------------------------------------- the fast paths against their definitions
# The per-doc steps count with numpy and over distinct words; these are the plain per-word definitions they must equal.
def ref_top_share(words: list[str], n: int) -> float:
    """Chars of the most frequent n-gram (Counter.most_common: the first seen among equals) × its count."""
    from collections import Counter

    if len(words) < n:
        return 0.0
    gram, count = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1)).most_common(1)[0]
    return sum(len(w) for w in gram) * count / max(1, sum(len(w) for w in words))


def ref_dup_share(words: list[str], n: int) -> float:
    """Share of word chars covered by an n-gram that occurred earlier."""
    if len(words) < n:
        return 0.0
    seen, dup = set(), [False] * len(words)
    for i in range(len(words) - n + 1):
        g = tuple(words[i:i + n])
        if g in seen:
            dup[i:i + n] = [True] * n
        seen.add(g)
    return sum(len(w) for w, d in zip(words, dup) if d) / max(1, sum(len(w) for w in words))


def ref_quality_counts(text: str) -> tuple[int, int, int, int]:
    """Words (runs of non-space), words with a letter, stop words (lowered, stripped), and the symbol count."""
    import re

    words = re.findall(r"\S+", text)
    alpha = sum(bool(re.search(r"[^\W\d_]", w)) for w in words)
    stop = sum(w.lower().strip(".,;:!?\"'()") in F.STOP_WORDS for w in words)
    sym = sum(w.count("#") + w.count("...") + w.count("…") for w in words)
    return len(words), alpha, stop, sym


def tricky_docs(k: int = 600) -> list[str]:
    """Few distinct words (ties, repeats), letters only under case folding, digits of other scripts, symbols."""
    import random

    rng = random.Random(5)
    vocab = ["the", "The", "THE.", "(the)", "'to'", "wİth", "İs", "a", "b", "c", "12", "٣٤", "#x", "...", "…", "a...",
             "_", "x_1", "é", "da\u0301", "ﬁ", "K", "Ⅻ", "ⓐ", "—", "[1]", "x" * 1200, "\u00a0", "\u2003"]
    out = []
    for _ in range(k):
        v = vocab[:rng.randint(2, len(vocab))]
        out.append("".join(rng.choice(v) + rng.choice([" ", " ", "\n", "\n\n", "\t", "\u00a0", "\x1c"])
                           for _ in range(rng.randint(0, 300))))
    return out


def test_ngram_shares_equal_their_definitions_on_real_and_tricky_docs():
    docs = [d["text"] for d in c4_docs(200)] + tricky_docs()
    for text in docs:
        doc = F.Doc(text)
        words = [w.lower() for w in text.split()]
        assert doc.lower_words == words
        grams = F.NGrams(doc.lower_words, doc.word_counts)
        for n in range(1, 12):
            assert grams.top_share(n) == ref_top_share(words, n), (n, text[:80])
            assert grams.dup_share(n) == ref_dup_share(words, n), (n, text[:80])


def test_gopher_quality_counts_equal_their_definitions():
    """The counts the step compares, taken per distinct word and from the text, equal the per-word ones; the rule a
    doc fails names the same reason as a step written per word would."""
    g = only("gopher_quality").gopher_quality
    for text in [d["text"] for d in c4_docs(200)] + tricky_docs():
        n, alpha, stop, sym = ref_quality_counts(text)
        doc = F.Doc(text)
        assert len(doc.words) == n
        counts = doc.word_counts
        assert sum(counts[w] for w in F._NO_LETTER_RE.findall("\n".join(counts))) == n - alpha
        assert sum(c for w, c in counts.items() if w.strip(F.STOP_STRIP) in F.STOP_WORDS) == stop
        assert text.count("#") + text.count("...") + text.count("…") == sym
        if g.min_words <= n and n - alpha > (1 - g.min_alpha_words_ratio) * n and stop >= g.stop_words_min:
            assert F.gopher_quality(doc, g) in ("gopher_quality.alpha_words", "gopher_quality.mean_word_len",
                                                "gopher_quality.symbol_ratio", "gopher_quality.bullet_lines",
                                                "gopher_quality.ellipsis_lines", "gopher_quality.word_count")


def test_the_repetition_step_stops_early_only_where_no_larger_n_can_fail():
    """dup_share never grows with n (a repeated n-gram's two (n-1)-grams are repeated), so the step skips an n whose
    threshold is at least a smaller n's share; with thresholds that grow with n, a large n still fails."""
    text = " ".join(f"w{i}" for i in range(40)) + " " + " ".join(f"w{i}" for i in range(12))
    words = text.split()
    shares = [ref_dup_share(words, n) for n in range(1, 14)]
    assert all(a >= b for a, b in zip(shares, shares[1:]))
    cfg = load_spec(None, ["data.filters.steps=[gopher_repetition]",
                           "data.filters.gopher_repetition.top_ngram_max_share={}",
                           "data.filters.gopher_repetition.dup_ngram_max_share={5: 0.9, 10: 0.1}"], env={}).data.filters
    assert F.filter_reason(text, cfg) == "gopher_repetition.dup_10gram"


def test_a_line_left_blank_by_citation_removal_is_dropped_not_a_crash():
    """'[1]' + 1,001 spaces + '[2]': longer than the longest word allowed, no word once the citations go."""
    text = "[1]" + " " * 1001 + "[2]\n" + "A fine sentence here. " * 6
    reason, doc = F.apply_filters(text, only("c4"))
    assert reason is None and doc.info["c4_lines_dropped"] == 1 and "[1]" not in doc.text


def test_ngram_sizes_below_one_are_refused_by_the_spec_and_levels_restart_for_a_smaller_n():
    import pydantic
    import pytest

    for key in ("top_ngram_max_share", "dup_ngram_max_share"):
        with pytest.raises(pydantic.ValidationError, match="n-gram sizes must be 1 or more"):
            FilterCfg.model_validate({"gopher_repetition": {key: {0: 0.5, 5: 0.15}}})
    words = "a b a b c a b a b c d".split()
    grams = F.NGrams(words)
    later = [grams.dup_share(5), grams.top_share(2), grams.dup_share(3)]  # 5, then back to 2 and 3
    assert later == [ref_dup_share(words, 5), ref_top_share(words, 2), ref_dup_share(words, 3)]


def test_no_words_and_min_words_zero_is_a_word_count_removal():
    cfg = load_spec(None, ["data.filters.steps=[gopher_quality]", "data.filters.gopher_quality.min_words=0"],
                    env={}).data.filters
    assert F.filter_reason("   \n ", cfg) == "gopher_quality.word_count"
