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
