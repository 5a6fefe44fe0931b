from pipelines.data import filters as F
from pipelines.spec import FilterCfg

from conftest import c4_docs

CFG = FilterCfg()
PROSE = ("The committee met on Tuesday to discuss the budget and the plans that have been made for the new "
         "library. Members of the public were invited to share their views with the board, and many of them "
         "spoke about the need for longer opening hours and more space for children to read and study. "
         "The chair thanked everyone for coming and said that the final decision would be made next month.")


def test_clean_prose_is_kept():
    assert F.filter_reason(PROSE, CFG) is None


def test_each_rule_fires_on_its_defect():
    assert F.filter_reason("too short to be a document", CFG) == "gopher_word_count"
    assert F.filter_reason(" ".join(["supercalifragilisticexpialidocious"] * 60), CFG) == "gopher_mean_word_len"
    assert F.filter_reason(PROSE + " #tag" * 20, CFG) == "gopher_symbol_ratio"
    bullets = "\n".join(f"• remember the important information about registration {i}" for i in range(60))
    assert F.filter_reason(bullets, CFG) == "gopher_bullet_lines"
    ell = "\n".join(f"read more about the story and the people of the town {i}..." for i in range(20))
    assert F.filter_reason(ell, CFG) == "gopher_ellipsis_lines"
    nums = " ".join(str(1000 + i) for i in range(200)) + " the and of"
    assert F.filter_reason(nums, CFG) == "gopher_alpha_words"
    no_stop = " ".join(["lorem ipsum dolor sit amet consectetur adipiscing elit"] * 10)
    assert F.filter_reason(no_stop, CFG) == "gopher_stop_words"
    dup = "\n".join(["the cat sat on the mat with a hat and of that"] * 10 + [PROSE])
    assert F.filter_reason(dup, CFG) == "gopher_dup_lines"


def test_on_real_c4_docs_every_removal_has_a_known_reason():
    docs = c4_docs(300)
    reasons = [F.filter_reason(d["text"], CFG) for d in docs]
    kept = sum(r is None for r in reasons)
    assert 0.4 * len(docs) < kept < len(docs)  # real web text: most kept, some removed
    rule_names = {"gopher_word_count", "gopher_mean_word_len", "gopher_symbol_ratio", "gopher_bullet_lines",
                  "gopher_ellipsis_lines", "gopher_alpha_words", "gopher_stop_words", "gopher_dup_lines",
                  "gopher_dup_line_chars"}
    assert {r for r in reasons if r} <= rule_names
    assert "gopher_word_count" in reasons  # C4 has short pages
